"""Sweep records as people read them: the key that identifies a point (resume), the speedup of
each layout over the TP baseline of the same sweep, and one flat CSV row per record."""

from __future__ import annotations

import csv
import json
import os

from helix.errors import ConfigError

# leading CSV columns, in this order; every other field follows in first-seen order
CSV_FIRST = ("sweep", "model", "layout.kvp", "layout.tpa", "layout.tpf", "layout.ep",
             "layout.kv_interleave", "world_size", "batch", "context", "step_ms_median",
             "step_ms_p90", "floor_ms", "floor_ratio", "speedup_vs_tp", "tokens_per_s",
             "tokens_per_s_per_user", "tokens_per_s_per_gpu", "cuda_graphs", "attention_backend")


def record_key(rec: dict) -> tuple:
    """What makes two records the same point: sweep name, model, layout, batch, context."""
    lay = rec["layout"]
    return (rec.get("sweep"), rec["model"],
            tuple(sorted((k, v) for k, v in lay.items())), rec["batch"], rec["context"])


def _tp_peer(rec: dict, records: list[dict]) -> dict | None:
    """The TP-baseline record (kvp = 1) of the same sweep, model, batch and context on as many
    GPUs; of several, the one with the same FFN layout, then the first."""
    lay = rec["layout"]
    peers = [r for r in records
             if r["layout"]["kvp"] == 1 and r.get("sweep") == rec.get("sweep")
             and r["model"] == rec["model"] and r["batch"] == rec["batch"]
             and r["context"] == rec["context"]
             and r["layout"]["kvp"] * r["layout"]["tpa"] == lay["kvp"] * lay["tpa"]]
    same_ffn = [r for r in peers if (r["layout"].get("tpf"), r["layout"].get("ep"))
                == (lay.get("tpf"), lay.get("ep"))]
    return (same_ffn or peers or [None])[0]


def add_speedup_vs_tp(records: list[dict]) -> list[dict]:
    """Set `speedup_vs_tp` = TP baseline step / this step on every record (None without a TP
    baseline in the sweep at that model, batch, context and GPU count)."""
    for rec in records:
        peer = _tp_peer(rec, records)
        rec["speedup_vs_tp"] = (peer["step_ms_median"] / rec["step_ms_median"]
                                if peer is not None and rec.get("step_ms_median") else None)
    return records


def _flat(rec: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in rec.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, name + "."))
        elif isinstance(v, (list, tuple)):
            out[name] = ";".join(map(str, v))
        else:
            out[name] = v
    return out


def write_csv(records: list[dict], path: str) -> None:
    """One row per record; nested fields flattened (`layout.kvp`), lists joined with ';'."""
    rows = [_flat(r) for r in records]
    cols = [c for c in CSV_FIRST if any(c in r for r in rows)]
    for r in rows:
        cols += [k for k in r if k not in cols]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})


def read_records(path: str) -> list[dict]:
    """Records of an earlier `helix sweep --out` (a JSON list), for --resume."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot resume from {path}: {e}; "
                          f"move it away or drop --resume") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) and "layout" in r for r in data):
        raise ConfigError(f"cannot resume from {path}: not a list of sweep records; move it away "
                          f"or drop --resume")
    return data


def write_json(records: list[dict], path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(records, f, indent=1)
    os.replace(tmp, path)        # a kill mid-write keeps the previous file
