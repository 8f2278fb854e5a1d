"""Hardware files for the planner (configs/hardware/*.yaml): one GPU's memory and rates, the
per-kernel and per-step overheads, and the links between GPUs.

    name: NVIDIA H200 SXM
    hbm_gib: 139.8                 # HBM per GPU
    reserve_gib: 10                # kept for activations, graphs, NCCL buffers, allocator slack
    hbm_read_tbps: 4.45            # streaming read rate a step's weight and KV reads reach
    copy_tbps: 4.25                # device-to-device copy (read + write), for reference
    matmul_tflops: 790             # dense GEMM in the serving dtype
    kernel_us: 2.0                 # fixed cost of one kernel (launch gap, ramp-up, tail)
    graph_step_factor: 1.06        # a graphed step / the sum of its kernel times
    gqa_attention_efficiency: 0.9  # fraction of hbm_read_tbps the GQA decode kernel reaches
    mla_attention_efficiency: 0.44 # fraction of matmul_tflops the absorbed-MLA kernel reaches
    fp8_expert_efficiency: 0.7     # fp8 experts: their stream's rate against 16-bit experts'
    nvlink: {domain_gpus: 8, bus_gbps: 284, latency_us: 6, hop_us: 1.5}
    network: {bus_gbps: 45, latency_us: 15, hop_us: 4}

A collective over `n` ranks costs latency_us + hop_us * hops + wire bytes / bus_gbps on the
NVLink when n <= domain_gpus, else on the network: all_to_all 1 hop and (n-1)/n of the buffer
on the wire; all_reduce (ring) 2(n-1) hops and 2(n-1)/n of it; all_gather n-1 hops and n-1
times the rank's part. Every key is required; a mistake is one line naming the key, its line
and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import yaml

from helix.errors import ConfigError

HARDWARE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs", "hardware")


@dataclass(frozen=True)
class Link:
    bus_gbps: float           # GB/s a rank's wire bytes cross at (large messages)
    latency_us: float         # fixed cost of one collective (small messages, inside a graph)
    hop_us: float             # added per algorithm step (ring hop, peer)
    domain_gpus: int = 0      # GPUs one link domain joins (NVLink); 0 for the network


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_gib: float
    reserve_gib: float
    hbm_read_tbps: float
    copy_tbps: float
    matmul_tflops: float
    kernel_us: float
    graph_step_factor: float
    gqa_attention_efficiency: float
    mla_attention_efficiency: float
    fp8_expert_efficiency: float
    nvlink: Link
    network: Link
    path: str = ""

    @property
    def read_bps(self) -> float:
        return self.hbm_read_tbps * 1e12

    @property
    def flops(self) -> float:
        return self.matmul_tflops * 1e12

    @property
    def usable_bytes(self) -> float:
        return (self.hbm_gib - self.reserve_gib) * 2**30

    def link(self, ranks: int) -> Link:
        return self.nvlink if ranks <= self.nvlink.domain_gpus else self.network

    def collective_s(self, kind: str, ranks: int, nbytes: float) -> float:
        """Seconds of one collective over `ranks` ranks; nbytes: this rank's buffer (all_to_all,
        all_reduce) or its part (all_gather)."""
        if ranks <= 1:
            return 0.0
        hops, wire = {"all_to_all": (1, nbytes * (ranks - 1) / ranks),
                      "all_reduce": (2 * (ranks - 1), 2 * nbytes * (ranks - 1) / ranks),
                      "all_gather": (ranks - 1, nbytes * (ranks - 1))}[kind]
        link = self.link(ranks)
        return (link.latency_us + link.hop_us * hops) * 1e-6 + wire / (link.bus_gbps * 1e9)


_LINK_KEYS = {"nvlink": ("domain_gpus", "bus_gbps", "latency_us", "hop_us"),
              "network": ("bus_gbps", "latency_us", "hop_us")}
_FRACTIONS = ("gqa_attention_efficiency", "mla_attention_efficiency", "fp8_expert_efficiency")


def _key_lines(text: str) -> dict[str, int]:
    """'key' and 'parent.key' -> 1-based line of the key in the YAML text."""
    lines: dict[str, int] = {}

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                name = f"{prefix}{k.value}"
                lines[name] = k.start_mark.line + 1
                walk(v, name + ".")
    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return lines


def _number(spec: dict, key: str, where, fix: str, integer: bool = False) -> float:
    if key not in spec:
        raise ConfigError(f"{where(key)}: missing key '{key}' ({fix})")
    v = spec[key]
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or v < 0:
        kind = "a non-negative integer" if integer else "a non-negative number"
        raise ConfigError(f"{where(key)}: '{key}' must be {kind} ({fix}), got {v!r}")
    return v


def _check_keys(spec: dict, allowed, where, prefix: str = "") -> None:
    for k in spec:
        if k not in allowed:
            raise ConfigError(f"{where(prefix + str(k))}: unknown key '{prefix}{k}'; allowed: "
                              f"{', '.join(allowed)}")


def hardware_path(name: str) -> str:
    """A path, or a preset name in configs/hardware (h200, b200, ...)."""
    if os.path.isfile(name):
        return name
    preset = os.path.join(HARDWARE_DIR, f"{name}.yaml")
    if os.path.isfile(preset):
        return preset
    known = sorted(f[:-5] for f in os.listdir(HARDWARE_DIR)) if os.path.isdir(HARDWARE_DIR) else []
    raise ConfigError(f"hardware {name!r} not found: give a YAML path or one of {', '.join(known)}")


def load_hardware(name: str) -> Hardware:
    path = hardware_path(name)
    try:
        with open(path) as f:
            text = f.read()
        spec = yaml.safe_load(text)
    except OSError as e:
        raise ConfigError(f"cannot read hardware file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{at}: invalid YAML "
                          f"({getattr(e, 'problem', None) or e})") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: a hardware file is a mapping of keys "
                          f"(see configs/hardware/h200.yaml)")
    lines = _key_lines(text)

    def where(key):
        return f"{path}:{lines[key]}" if key in lines else path

    top = [f.name for f in fields(Hardware) if f.name != "path"]
    _check_keys(spec, top, where)
    values = {}
    for key in top:
        if key == "name":
            values[key] = str(spec.get("name") or os.path.basename(path))
        elif key in _LINK_KEYS:
            sub = spec.get(key)
            if not isinstance(sub, dict):
                raise ConfigError(f"{where(key)}: '{key}' must be a mapping of "
                                  f"{', '.join(_LINK_KEYS[key])}, e.g. {key}: {{bus_gbps: 400, "
                                  f"latency_us: 6, hop_us: 1.5}}")
            _check_keys(sub, _LINK_KEYS[key], where, key + ".")

            def sub_where(k, key=key):
                return where(f"{key}.{k}")
            link = {k: _number(sub, k, sub_where, "see configs/hardware/h200.yaml",
                               integer=k == "domain_gpus") for k in _LINK_KEYS[key]}
            if link["bus_gbps"] <= 0:
                raise ConfigError(f"{sub_where('bus_gbps')}: '{key}.bus_gbps' must be > 0")
            values[key] = Link(**link)
        else:
            values[key] = _number(spec, key, where, "see configs/hardware/h200.yaml")
    for key in ("hbm_gib", "hbm_read_tbps", "matmul_tflops", "graph_step_factor", *_FRACTIONS):
        if values[key] <= 0:
            raise ConfigError(f"{where(key)}: '{key}' must be > 0, got {values[key]}")
    for key in _FRACTIONS:
        if values[key] > 1:
            raise ConfigError(f"{where(key)}: '{key}' is a fraction of the peak: give a number in "
                              f"(0, 1], got {values[key]}")
    if values["reserve_gib"] >= values["hbm_gib"]:
        raise ConfigError(f"{where('reserve_gib')}: 'reserve_gib' ({values['reserve_gib']}) "
                          f"must be below hbm_gib ({values['hbm_gib']})")
    return Hardware(**values, path=path)
