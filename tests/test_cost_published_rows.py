"""Rows of the published tables read as what ran (issue 35): which stack each ran, which a
rule leaves out of the goal set, which its own table contradicts. Each rule reads the rows'
printed data, never the model's error."""

import statistics

from tplab import cost
from tplab.cost import published, scores


def test_llm_foundrys_large_scale_rows_name_the_kernel_their_sweep_ran():
    # #838's sweep.py (5e85bd62d): attn_impl flash for 1b, 3b, 7b, 70b; triton for 13b, 30b
    large = [r for r in published.ROWS if "Large Scale" in r["where"]]
    assert len(large) == 18
    for r in large:
        flash = r["model"] in ("MPT 1B", "MPT 3B", "MPT 7B", "MPT 70B")
        assert r["stack"] == ("llm-foundry-2024" if flash else "llm-foundry-2023"), r["where"]
    new, old = cost.STACKS["llm-foundry-2024"], cost.STACKS["llm-foundry-2023"]
    assert new.attention_scale == 1.0 > old.attention_scale
    assert (new.kernels, new.fsdp_exposed, new.block, new.logits_bytes) == (
        old.kernels, old.fsdp_exposed, old.block, old.logits_bytes)


def test_pure_bf16_states_leave_the_goal_set_as_the_40gb_table_did():
    pure = [r for r in published.RUNS if "bf16 PURE" in r["printed"]]
    assert [(r["model"], r["gpus"], r["hardware"]) for r in pure] == [
        ("MPT 70B", 64, "A100 SXM"), ("MPT 70B", 32, "A100 SXM")]
    assert all("bf16 PURE" in r["excluded"] for r in pure)
    assert not any(r["excluded"] for r in published.RUNS
                   if r["source"] == published.FOUNDRY and r not in pure)


def test_a_row_its_own_table_contradicts_is_found_from_the_measurements_alone():
    pairs = published.foundry_pairs(published.RUNS)
    ratios = {a["where"]: h["measured"] / a["measured"] for h, a in pairs}
    flagged = published.foundry_disagreeing(published.RUNS)
    assert [r["model"] for r in flagged] == ["MPT 760M"] and flagged[0]["seq_len"] == 512
    mid = statistics.median(ratios.values())
    others = [x for w, x in ratios.items() if w != flagged[0]["where"]]
    assert ratios[flagged[0]["where"]] > max(others) and ratios[flagged[0]["where"]] > 1.3 * mid
    # the cause printed for it names the rule
    assert "foundry_disagreeing" in scores.cause(flagged[0] | {"fit_setting": {}})
    # a table whose pairs all agree flags nothing
    same = [r | {"measured": 2.0 * a["measured"]} if r is h else r
            for h, a in pairs for r in (h,)]
    assert published.foundry_disagreeing(same + [a for _, a in pairs]) == []


def test_a_row_slower_than_its_own_sweeps_longer_sequence_is_found_from_the_measurements():
    flagged = published.slower_with_less_work(published.RUNS)
    assert sorted((r["model"], r["seq_len"], r["hardware"]) for r in flagged) == [
        ("MPT 760M", 512, "A100 SXM"), ("MPT 760M", 1024, "A100 SXM")]
    # the 1024-token row is the one no other rule names, and its cause names this one
    at_1024 = next(r for r in flagged if r["seq_len"] == 1024)
    assert at_1024["where"] not in scores.DISAGREEING
    assert "slower_with_less_work" in scores.cause(at_1024 | {"fit_setting": {}})
    # the row it is measured against: same tokens per micro-batch and per step, 2048 tokens
    longer = [r for r in published.RUNS if r["source"] == at_1024["source"]
              and r["model"] == at_1024["model"] and r["hardware"] == at_1024["hardware"]
              and r["seq_len"] == 2048 and r["gpus"] == at_1024["gpus"]]
    assert len(longer) == 1
    assert longer[0]["micro_batch"] * 2048 == at_1024["micro_batch"] * 1024
    assert longer[0]["measured"] > at_1024["measured"]
    # the sweep as physics orders it (the shorter row at least as fast) flags nothing
    fixed = [r | {"measured": 1.1 * longer[0]["measured"]} if r in flagged else r
             for r in published.RUNS]
    assert published.slower_with_less_work(fixed) == []
    # and only rows with the same tokens per micro-batch are compared
    halved = [r | {"micro_batch": r["micro_batch"] // 2} if r is at_1024 else r
              for r in published.RUNS]
    assert at_1024["where"] not in {r["where"] for r in published.slower_with_less_work(halved)}


def test_llama_3s_8k_rows_are_priced_as_its_text_reads_them():
    # section 3.3.2: "we use an interleaved schedule ... with V pipeline stages on one
    # pipeline rank" and "we could pre-train Llama 3 on sequences of 8K tokens without
    # activation checkpointing": no recomputation is read, not assumed, and V >= 2 is tried
    rows = {r["where"]: r for r in published.RUNS if r["source"] == published.LLAMA3}
    for where in ("8192 GPUs, CP 1", "16384 GPUs, CP 1"):
        r = rows[where]
        assert r["recompute"] == "none" and published.unprinted(r) == ["vpp"]
        assert published.tried(r, "vpp") == (4, 3, 2)
    assert published.unprinted(rows["16384 GPUs, CP 16"]) == ["recompute", "vpp"]
    assert published.tried(rows["16384 GPUs, CP 16"], "recompute") == published.TRIED[
        "recompute"]
    # the 8K-GPU row (m = 32 micro-batches a pipeline) fits at no V >= 2 in the model: the
    # model says a run that ran cannot run, and the row is priced as read, not at a
    # recomputation the paper rules out
    setting, p = published.fitting(rows["8192 GPUs, CP 1"])
    assert setting == {} and not p.fits and p.run.recompute == "none" and p.run.vpp == 4
    for vpp in (2, 4):
        assert not cost.predict(published.to_run(rows["8192 GPUs, CP 1"], vpp=vpp)).fits
    # at 16K GPUs (m = 16 = p) the first rank holds m micro-batches and the row fits
    assert published.fitting(rows["16384 GPUs, CP 1"])[1].fits
    out = published.compare([rows["8192 GPUs, CP 1"]])
    assert out["rows"][0]["fit_setting"] == {} and not out["rows"][0]["fits"]
