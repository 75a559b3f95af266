"""The exercises' answers, right and wrong: the reference `solutions`, the typical `mistakes`
and the clipping answers (`clipping`). They run on the ranks (a check sends them there) and
the notebook shows and judges them, so they live on both sides; the exercises themselves
(tasks, hints, checks, feedback) are the notebook's: tplab/exercises/.
"""
