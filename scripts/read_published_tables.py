"""Read published tables from a source's own git checkout into tplab/cost/data/*.json.

    python scripts/read_published_tables.py llm-foundry /path/to/llm-foundry.git
    python scripts/read_published_tables.py torchtitan-memory /path/to/torchtitan.git

Each row keeps the table it is read from and its line in the file; nothing is typed by hand.
The files it writes are what `tplab.cost.published` loads (no download at run time).
"""

import json
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tplab" / "cost" / "data"
FOUNDRY_COMMIT = "495218376830947dce625efabc4d86be7c47cc45"   # the README's last change
FOUNDRY_FILE = "scripts/train/benchmarking/README.md"
FOUNDRY_TABLES = {"## H100 80GB BF16": "H100 SXM",
                  "## A100 80GB with 1600 Gbps node-node interconnect (RoCE)": "A100 SXM"}
TITAN_COMMIT = "eaea6f6"


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
            "precision": "bf16", "stack": "llm-foundry-2023",
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
        "tables": "; ".join(t[3:] for t in FOUNDRY_TABLES) + " (every row of both)"}, rows)
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


if __name__ == "__main__":
    {"llm-foundry": llm_foundry, "torchtitan-memory": torchtitan_memory}[sys.argv[1]](
        sys.argv[2])
