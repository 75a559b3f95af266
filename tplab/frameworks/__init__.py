"""Frameworks' own tensor-parallel code checked by tplab (both sides: adapters run on the
ranks). Adapters are imported by name (`from tplab.frameworks import torchtitan`), so that
`import tplab` needs none of the frameworks installed.
"""
