"""Read published tables from a source's own git checkout into tplab/cost/data/*.json.

    python scripts/read_published_tables.py llm-foundry /path/to/llm-foundry.git
    python scripts/read_published_tables.py torchtitan-memory /path/to/torchtitan.git
    python scripts/read_published_tables.py megatron-bridge /path/to/Megatron-Bridge.git
    python scripts/read_published_tables.py dgxc /path/to/dgxc-benchmarking.git

Each row keeps the table it is read from and its line in the file; nothing is typed by hand.
The files it writes are what `tplab.cost.published` loads (no download at run time).
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from tplab import cost

DATA = Path(__file__).resolve().parents[1] / "tplab" / "cost" / "data"
FOUNDRY_COMMIT = "495218376830947dce625efabc4d86be7c47cc45"   # the README's last change
FOUNDRY_FILE = "scripts/train/benchmarking/README.md"
FOUNDRY_TABLES = {"## H100 80GB BF16 (Large Scale, >= 128 GPUs)": "H100 SXM",
                  "## H100 80GB BF16": "H100 SXM",
                  "## H100 80GB FP8": "H100 SXM",
                  "## A100 80GB with 1600 Gbps node-node interconnect (RoCE)": "A100 SXM"}
FOUNDRY_PRECISIONS = {"amp_bf16": "bf16", "bf16": "bf16", "amp_fp8": "fp8"}
TITAN_COMMIT = "eaea6f6"
BRIDGE_COMMIT = "4ab94dfad"        # docs/performance-summary-archive.md's last change read
BRIDGE_FILE = "docs/performance-summary-archive.md"
BRIDGE_SYSTEMS = {"DGX-GB200": "GB200 NVL72", "DGX-B200": "B200", "DGX-H100": "H100 SXM"}
BRIDGE_MODELS = {"LLAMA3_8B": "Llama-3 8B", "LLAMA3_70B": "Llama-3 70B",
                 "LLAMA3.1_405B": "Llama-3.1 405B"}
BRIDGE_PRECISIONS = {"FP8-CS": "fp8", "FP8": "fp8", "BF16": "bf16"}

# dgxc-benchmarking's llama3.1 README printed measured step times in the releases below (later
# releases print configurations only, and an illustrative `llmb-run jobs` listing).
# (release commit, file): release, system, NeMo container (each recipe's launch.sh FW_VERSION)
DGXC_FILE = "llama3.1/README.md"
DGXC_READS = {("85380ff", "llama3.1/README.md"): ("v25.04.01", "H100 SXM", "25.02.01"),
              ("85380ff", "nemo_megatron/README_175b.md"): ("v25.04.01", "H100 SXM", "24.12"),
              ("85380ff", "nemotron/README.md"): ("v25.04.01", "H100 SXM", "25.02.01"),
              ("68eaf7e", "llama3.1/README.md"): ("v25.05", "GB200 NVL72", "25.04.01")}
DGXC_MODELS = {"8b": "Llama-3 8B", "70b": "Llama-3 70B", "405b": "Llama-3.1 405B",
               "405b-Proxy": "Llama-3.1 405B", "175b": "GPT-3 175B",
               "15b": None, "340b": None}    # Nemotron-4: no cost.MODELS shape, kept unscored


def show(git_dir: str, commit: str, path: str) -> list[str]:
    return subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout.splitlines()


def dump(path: Path, meta: dict, rows: list[dict]) -> None:
    """One row a line, so a diff shows the rows that changed."""
    head = json.dumps(meta, indent=1)[:-2]
    body = ",\n  ".join(json.dumps(r) for r in rows)
    path.write_text(f'{head},\n "rows": [\n  {body}\n ]\n}}\n')


def foundry_row(cells: list[str], hardware: str, table: str, line: int) -> dict:
    model, seq, gpus, _, mfu, _, _, mb, accum, gbs = cells[:10]
    tps, mode, strategy, ac = cells[12], cells[15], cells[16], cells[17]
    return {"where": f"{table[3:]}, {model} at {seq}, {gpus} GPUs, mb {mb}", "line": line,
            "model": f"MPT {model.upper() if model.endswith('b') else model.upper()}",
            "hardware": hardware, "gpus": int(gpus), "tp": 1, "pp": 1, "vpp": 1, "cp": 1,
            "micro_batch": int(mb), "global_batch": int(gbs), "grad_accum": int(accum),
            "seq_len": int(seq), "recompute": "full" if ac == "True" else "none",
            "sharding": {"FULL_SHARD": "fsdp", "SHARD_GRAD_OP": "zero2"}[strategy],
            "precision": FOUNDRY_PRECISIONS[cells[14]], "stack": "llm-foundry-2023",
            "printed": f"{tps} T/s/GPU (MFU {mfu}%, {cells[14]} {mode})",
            "measured": float(tps), "assumed": []}


def llm_foundry(git_dir: str) -> None:
    lines = show(git_dir, FOUNDRY_COMMIT, FOUNDRY_FILE)
    rows, table = [], None
    for i, text in enumerate(lines, 1):
        if text.startswith("## "):
            table = text.strip() if text.strip() in FOUNDRY_TABLES else None
        elif table and text.startswith("|  ") and text.split("|")[1].strip()[:1].isdigit():
            cells = [c.strip() for c in text.strip().strip("|").split("|")]
            rows.append(foundry_row(cells, FOUNDRY_TABLES[table], table, i))
    dump(DATA / "llm_foundry.json", {
        "source": "mosaicml/llm-foundry scripts/train/benchmarking/README.md",
        "repository": "mosaicml/llm-foundry", "commit": FOUNDRY_COMMIT, "file": FOUNDRY_FILE,
        "tables": "; ".join(t[3:] for t in FOUNDRY_TABLES) + " (every row of each)"}, rows)
    print(f"llm-foundry: {len(rows)} rows")


def torchtitan_memory(git_dir: str) -> None:
    """Add each row's printed peak memory (GiB) to torchtitan_h100.json, matched by table
    and the row's position in it."""
    lines = show(git_dir, TITAN_COMMIT, "docs/performance.md")
    peaks, table = {}, None
    for text in lines:
        if text.startswith("**Table "):
            table, k = int(text.split()[1].strip("*")), 0
        elif text.startswith("#"):
            table = None
        elif table and text.startswith("| ") and text.split("|")[-2].strip()[:1].isdigit():
            peaks[(table, k)] = float(text.split("|")[-2])
            k += 1
    path = DATA / "torchtitan_h100.json"
    data = json.loads(path.read_text())
    seen: dict[int, int] = {}
    for r in data["rows"]:
        t = int(r["where"].split(":")[0].split()[1])
        r["peak_gib"] = peaks[(t, seen.get(t, 0))]
        seen[t] = seen.get(t, 0) + 1
    rows = data.pop("rows")
    dump(path, data, rows)
    print(f"torchtitan: {len(rows)} peaks")


def bridge_row(container: str, heading: str, cells: dict, line: int) -> dict:
    """One row of a Megatron-Bridge pre-training table; `model`, `hardware` or
    `precision` None where the library has no name for what it prints (MoE models,
    GB300/B300 systems, MXFP8/NVFP4): kept, and left out by `published.exclusion`."""
    # "FP8-CS (FP8-MX)", "64 (0)": a second configuration in parentheses; the first is read
    # in every cell, the throughput's first figure with it; footnote marks dropped
    cells = {k: v if k in ("Model", "System") else v.split(" (")[0].split("[^")[0].strip()
             for k, v in cells.items()}
    system, model = cells.get("System", heading), cells.get("Model", heading)
    precision, tps = cells["Precision"], cells["Tokens / sec / GPU"]
    vp = cells["VP"]
    return {"where": f"{container} container, {system}, {model} {precision}", "line": line,
            "model": BRIDGE_MODELS.get(model), "printed_model": model,
            "hardware": BRIDGE_SYSTEMS.get(system), "printed_system": system,
            "gpus": int(cells["#-GPUs"]), "tp": int(cells["TP"]), "pp": int(cells["PP"]),
            "vpp": 1 if vp == "n/a" else int(vp), "cp": int(cells["CP"]),
            "micro_batch": int(cells["MBS"]), "global_batch": int(cells["GBS"]),
            "seq_len": int(cells["Sequence Length"]), "recompute": "none",
            "sharding": "fsdp" if int(cells.get("FSDP", "0")) > 0 else "zero1",
            "precision": BRIDGE_PRECISIONS.get(precision), "printed_precision": precision,
            "stack": "megatron-bridge", "printed": f"{tps} Tokens / sec / GPU",
            "measured": float(tps),
            "assumed": ["recompute none"] + (["FP8 current scaling as fp8"]
                                             if precision.startswith("FP8") else [])}


def megatron_bridge(git_dir: str) -> None:
    lines = show(git_dir, BRIDGE_COMMIT, BRIDGE_FILE)
    rows, container, pretraining, heading, header = [], None, False, "", None
    skipped: set[str] = set()
    for i, text in enumerate(lines, 1):
        if text.startswith("## "):
            container = text.split()[1] if text.strip().endswith("NeMo Container") else None
        elif text.startswith("### "):
            pretraining = text.strip() == "### Pre-Training Performance"
        elif text.startswith("#### "):
            heading, header = text.split(": ", 1)[1].strip(), None
        elif container and pretraining and text.startswith("|"):
            cells = [c.strip() for c in text.strip().strip("|").split("|")]
            if header is None:
                header = cells
            elif not cells[0].startswith("-") and "Precision" in header:
                rows.append(bridge_row(container, heading, dict(zip(header, cells, strict=True)),
                                       i))
            elif not cells[0].startswith("-"):
                skipped.add(container)      # 25.09: no precision printed; not read
    dump(DATA / "megatron_bridge.json", {
        "source": "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md",
        "repository": "NVIDIA-NeMo/Megatron-Bridge", "commit": BRIDGE_COMMIT,
        "file": BRIDGE_FILE, "tables": "every NeMo container's Pre-Training Performance "
        "table that prints a precision, every row (MoE models, GB300/B300, MXFP8 and NVFP4 "
        f"kept, not scored); not read (no precision column): {', '.join(sorted(skipped))}"},
        rows)
    print(f"Megatron-Bridge: {len(rows)} rows; not read: {sorted(skipped)}")


def cells_of(text: str) -> list[str]:
    return [c.strip() for c in text.strip().strip("|").split("|")]


def dgxc_tables(lines: list[str]) -> tuple[list[dict], list[tuple[str, str, list, int]]]:
    """The launch-configuration rows (dicts by header) and the measured tables
    (size, precision, [(gpus, step seconds)], line) of one release's README."""
    configs, times, header, title = [], [], None, None
    for i, text in enumerate(lines, 1):
        if "|" not in text or not (text.startswith("|") or title):   # nemotron: no lead |
            header = title = None
            continue
        cells = cells_of(text)
        if cells[0] in ("Size", "GPUs"):
            header = cells
        elif header and not cells[0].startswith("-"):
            configs.append(dict(zip(header, cells, strict=False)))
        elif cells[0].startswith(("Llama", "NeMo Megatron", "Nemotron")):
            title = cells
        elif title and cells[0].startswith("Training step time"):
            size, precision = title[0].split()[-2:]
            sizes = {c.get("Size") for c in configs}
            if size not in sizes and len(sizes) == 1:     # "NeMo Megatron BF16": one size
                size = sizes.pop() or size
            gpus = [int(t.split("x")[0]) for t in title[1:] if t]
            steps = [float(c) for c in cells[1:] if c]
            times.append((size, precision, list(zip(gpus, steps, strict=False)), i, []))
        elif title and cells[0].startswith("Throughput in tokens per second"):
            times[-1][4].extend(float(c) for c in cells[1:] if c)
    return configs, times


def dgxc_config(configs: list[dict], size: str, precision: str, gpus: int) -> dict:
    """The launch row for (size, precision, GPUs): a row printed 'BF16/FP8' holds both."""
    for c in configs:
        if (int(c["GPUs"]) == gpus and c.get("Size", size).startswith(size)
                and precision in c.get("Precision", precision).split("/")):
            return c
    raise ValueError(f"dgxc: no launch row for {size} {precision} on {gpus} GPUs")


def dgxc_batch(c: dict) -> tuple[int, list[str]]:
    """The global batch: MBS x DP x GA where the printed GBS disagrees with that product
    (nemo_megatron's 175B on 512 GPUs prints 1204 with DP 16, GA 64, MBS 1; its printed
    throughput, 2048 x 1024 / 8.42, is the product's), noted as read."""
    gbs, product = int(c["GBS"]), int(c["MBS"]) * int(c["DP"]) * int(c["GA"])
    if gbs == product:
        return gbs, []
    return product, [f"GBS {product} = MBS x DP x GA (printed {gbs})"]


def dgxc_row(c: dict, size: str, precision: str, gpus: int, step: float, where: tuple) -> dict:
    release, hardware, container, line, commit, file = where
    name = DGXC_MODELS[c.get("Size", size)]
    layers, seq = int(c["Layers"]), int(c["SeqLen"])
    gbs, notes = dgxc_batch(c)
    model: str | dict | None = name
    if name and layers != cost.MODELS[name].layers:    # a proxy: the model, fewer layers
        model = dataclasses.asdict(dataclasses.replace(
            cost.MODELS[name], layers=layers, name=f"{name} proxy ({layers} layers)"))
    return {"where": f"{release} {hardware} table, {c.get('Size', size)} {precision} on "
            f"{gpus} GPUs", "line": line, "commit": commit, "file": file, "release": release,
            "container": f"nvcr.io/nvidia/nemo:{container}", "model": model,
            "printed_model": f"{file.split('/')[0]} {c.get('Size', size)}",
            "hardware": hardware, "gpus": gpus, "tp": int(c["TP"]), "pp": int(c["PP"]),
            "vpp": 1 if c["VP"] in ("NA", "n/a") else int(c["VP"]), "cp": int(c["CP"]),
            "micro_batch": int(c["MBS"]), "global_batch": gbs, "seq_len": seq,
            "recompute": "none", "sharding": "fsdp" if c.get("FSDP", "0") not in ("0", "False")
            else "zero1", "precision": precision.lower(),
            "stack": "megatron-bridge",
            **({"fp8_recipe": "te-delayed"} if precision == "FP8" else {}),
            "printed": f"{step} s per step", "measured": round(seq * gbs / (step * gpus), 4),
            "assumed": ["recompute none"] + notes + (["FP8 delayed scaling as fp8"]
                                                     if precision == "FP8" else [])}


# v25.01 (NeMo 24.09) and v25.03 (NeMo 24.12) printed one README per size, each table's
# settings in its title
# ("Llama 3.1 405b BF16 (TP=8, PP=9, CP=2, VP=7, MBS=1, GA=63)"), a column per GPU count,
# and per-column rows (Layers, GBS, PP, VP) where a column differs
DGXC_SPLIT_FILES = ("llama3.1/README_8b.md", "llama3.1/README_70b.md",
                    "llama3.1/README_405b.md")
DGXC_SPLITS = (("143b90d", "v25.01", "24.09", DGXC_SPLIT_FILES),
               ("1b9bb6b", "v25.03", "24.12", DGXC_SPLIT_FILES))
"""The releases printed that way, each read once: v25.01 (NeMo 24.09; v24.11.1's tables
are the same), v25.03 (NeMo 24.12; v25.02's are the same). v25.01's titles name the
container ("Llama 3.1 70b 24.09 BF16 (...)")."""


def dgxc_split_tables(lines: list[str]) -> list[tuple[dict, int]]:
    """(launch settings, line) for every column of every measured table of one v25.03
    README: the title's settings, the column's GPUs (and GBS where its header prints it),
    then the per-column rows."""
    out, cols, line = [], None, 0
    for i, text in enumerate(lines, 1):
        if not text.startswith("|"):
            cols = None
            continue
        cells = cells_of(text)
        if cells[0].startswith("Llama") and "(" in cells[0]:
            name, settings = cells[0].split(" (", 1)
            size = next(w for w in name.split() if w in DGXC_MODELS)
            precision = name.split()[-1]
            base = {"Size": size, "Precision": precision, "SeqLen": "8192"}
            base |= dict(kv.split("=") for kv in settings.rstrip(")").split(", "))
            cols = []
            for head in (c for c in cells[1:] if c):
                col = base | {"GPUs": head.split("x")[0].split()[-1]}
                if "GBS=" in head:
                    col["GBS"] = head.split("GBS=")[1].rstrip(")")
                cols.append(col)
        elif cols is not None and not cells[0].startswith("-"):
            key = {"Training step time (seconds per step)": "step",
                   "Throughput in tokens per second": "tps"}.get(cells[0], cells[0])
            for col, v in zip(cols, (c for c in cells[1:] if c), strict=False):
                col[key] = v
            if key == "step":
                line = i
            if key == "tps":
                out.extend((c, line) for c in cols)
    return out


def dgxc_split(git_dir: str, rows: list[dict], commits: dict) -> None:
    for split in DGXC_SPLITS:
        dgxc_split_release(git_dir, rows, commits, *split)


def dgxc_split_release(git_dir: str, rows: list[dict], commits: dict, short: str,
                       release: str, container: str, files: tuple[str, ...]) -> None:
    """Every column of every table of one release's per-size READMEs; a step cell printed
    with a stray space (v25.01's 405B on 96 GPUs, "8.7  5") is read without it, which the
    throughput printed beside it confirms (tests/test_cost_runs.py). Where the step and the
    throughput disagree (v25.01's 70B BF16 on 2048 GPUs: 14.98 s printed, its throughput
    and MFU those of 14.92 s), the throughput is read, and the row says so."""
    commits[release] = subprocess.run(["git", "-C", git_dir, "rev-parse", short], check=True,
                                      capture_output=True, text=True).stdout.strip()
    for file in files:
        for c, line in dgxc_split_tables(show(git_dir, short, file)):
            c.setdefault("Layers", str(cost.MODELS[DGXC_MODELS[c["Size"]]].layers))
            dp = int(c["GPUs"]) // (int(c["TP"]) * int(c.get("PP", "1")) * int(c["CP"]))
            c |= {"DP": str(dp), "PP": c.get("PP", "1"), "VP": c.get("VP", "n/a")}
            c.setdefault("GBS", str(int(c["MBS"]) * dp * int(c["GA"])))
            where = (release, "H100 SXM", container, line, commits[release], file)
            step, tps = float(c["step"].replace(" ", "")), float(c["tps"])
            row = dgxc_row(c, c["Size"], c["Precision"], int(c["GPUs"]), step, where)
            by_tps = row["seq_len"] * row["global_batch"] / tps
            if abs(by_tps / step - 1) > 1e-3:       # the throughput (and MFU) decide
                row["measured"] = round(tps / row["gpus"], 4)
                row["assumed"] = row["assumed"] + [
                    f"step {by_tps:.2f} s = tokens / printed throughput (printed {step})"]
            rows.append(row | {"printed_tokens_per_s": tps})


def dgxc_peak(lines: list[str], rows: list[dict], release: str, file: str) -> None:
    """v25.04.01's llama3.1/README.md shows one log line of a run with launch.sh's defaults
    (DTYPE bf16, MODEL_SIZE 8b; its MFU example divides by 8 GPUs) at its global batch:
    `peak_memory_usage` is `torch.cuda.max_memory_reserved()` (NeMo's MegatronStrategy,
    megatron_strategy.py at d2b21556, `log_memory_usage`), the allocator-reserved peak, the
    counter torchtitan prints. It goes on the 8B BF16 row of that batch as `peak_gib`."""
    for i, text in enumerate(lines, 1):
        if "peak_memory_usage:" not in text:
            continue
        fields = dict(f.strip().split(": ", 1) for f in text.split("|") if ": " in f)
        gbs, peak = int(fields["global_batch_size"]), int(fields["peak_memory_usage"])
        for r in rows:
            if (r["release"], r["file"], r["printed_model"], r["precision"], r["gpus"],
                    r["global_batch"]) == (release, file, "llama3.1 8b", "bf16", 8, gbs):
                r |= {"peak_gib": round(peak / 2**30, 2), "peak_line": i,
                      "peak_printed": f"peak_memory_usage: {peak} (step "
                      f"{fields['train_step_timing in s']} s in that log)"}


def dgxc(git_dir: str) -> None:
    rows, commits = [], {}
    for (short, file), (release, hardware, container) in DGXC_READS.items():
        commits[release] = subprocess.run(
            ["git", "-C", git_dir, "rev-parse", short], check=True, capture_output=True,
            text=True).stdout.strip()
        configs, times = dgxc_tables(show(git_dir, short, file))
        for size, precision, steps, line, throughputs in times:
            for (gpus, step), tps in zip(steps, throughputs, strict=True):
                c = dgxc_config(configs, size, precision, gpus)
                where = (release, hardware, container, line, commits[release], file)
                rows.append(dgxc_row(c, size, precision, gpus, step, where)
                            | {"printed_tokens_per_s": tps})
        dgxc_peak(show(git_dir, short, file), rows, release, file)
    dgxc_split(git_dir, rows, commits)
    dump(DATA / "dgxc.json", {
        "source": "NVIDIA/dgxc-benchmarking recipe READMEs",
        "repository": "NVIDIA/dgxc-benchmarking", "commit": commits["v25.05"],
        "file": DGXC_FILE, "tables": "every 'Training step time (seconds per step)' table of "
        "llama3.1/README_{8b,70b,405b}.md in v25.01 (H100; NeMo 24.09) and v25.03 (H100; "
        "NeMo 24.12), "
        "llama3.1/README.md in v25.04.01 (H100; NeMo 25.02.01) and v25.05 (GB200; NeMo "
        "25.04.01), nemo_megatron/README_175b.md (GPT-3 175B; NeMo 24.12) and "
        "nemotron/README.md (Nemotron-4 15B, 340B: no cost.MODELS shape, kept unscored) in "
        "v25.04.01, each with its launch row from the same file; each row names its commit "
        "and file. Later releases print configurations only"}, rows)
    print(f"dgxc: {len(rows)} rows")


if __name__ == "__main__":
    {"llm-foundry": llm_foundry, "torchtitan-memory": torchtitan_memory,
     "megatron-bridge": megatron_bridge, "dgxc": dgxc}[sys.argv[1]](sys.argv[2])
