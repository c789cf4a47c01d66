"""GPUs and clusters for the dry run (``python -m pipeengine.plan``): spec-sheet presets and the links of a world.

Torch-free data and rank arithmetic. A :class:`Gpu` is what the projection needs of one device: its dense peak
bf16 TFLOP/s, its memory, its memory bandwidth (the optimizer's pass over its state), the bandwidth to another GPU
of its node (NVLink, or PCIe where there is none) and to a GPU of another node (the network, per GPU).

Numbers from the vendors' data sheets (dense, i.e. without the 2:4 sparsity figure; the SXM parts). The peak
TFLOP/s are the trainer's: ``training/resources.py`` ``PEAK_TFLOPS`` (its bf16 column) is the one table of GPU
peaks; it is not imported here because that module imports torch and ``--help``/``--list-gpus`` stay torch-free,
so tests/training/test_projection.py checks that every preset's figure is that table's. The NVLink
figure is the data sheet's total over both directions halved (what one transfer gets one way; also the
bus bandwidth a ring all-reduce reaches at best). The inter-node figure is not a property of the GPU but of the
cluster: the presets take a DGX/HGX-style node, one NIC per GPU (ConnectX-7 at 400 Gbit/s for H100/H200,
200 Gbit/s HDR for A100; 100 Gbit/s per GPU for L40S servers, which is an assumption, not a data sheet). Override
any of them with the command line's flags.

Ranks are placed as the engine places them (``Topology`` position-major: ``rank = position * dp + replica``),
``gpus_per_node`` consecutive ranks per node: a position's data-parallel group is contiguous ranks, and two
pipeline neighbours share a node only when ``dp`` is below the node's GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.links import Links

__all__ = ["Gpu", "GPUS", "World", "gpu_preset", "FIGURES", "RANGES", "GIB"]

GIB = 2**30
FIGURES = ("tflops", "memory_gib", "memory_gbs", "intra_gbs", "inter_gbs")   # a Gpu's figures, in order
# What a figure may be (inclusive): wide around today's parts, narrow enough that the projection stays finite and
# meaningful (1e300 TFLOP/s or 1e-300 GB/s would print infinite or 300-digit steps)
RANGES: dict[str, tuple[float, float, str]] = {
    "tflops": (1.0, 1e5, "TFLOP/s"), "memory_gib": (1.0, 1e5, "GiB"), "memory_gbs": (10.0, 1e6, "GB/s"),
    "intra_gbs": (0.1, 1e5, "GB/s"), "inter_gbs": (0.1, 1e5, "GB/s")}


@dataclass(frozen=True)
class Gpu:
    """One GPU as the projection sees it (rates in bytes/s and TFLOP/s, memory in GiB)."""

    name: str
    tflops: float              # dense peak bf16 tensor-core TFLOP/s
    memory_gib: float
    memory_gbs: float          # memory bandwidth, GB/s
    intra_gbs: float           # to a GPU of the same node, one way, GB/s
    inter_gbs: float           # to a GPU of another node, one way, GB/s (the network per GPU)
    source: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    def describe(self) -> str:
        return (f"{self.name}: {self.tflops:g} TFLOP/s dense bf16, {self.memory_gib:g} GiB at {self.memory_gbs:g} "
                f"GB/s, {self.intra_gbs:g} GB/s within a node, {self.inter_gbs:g} GB/s between nodes")


GPUS: dict[str, Gpu] = {
    "h100": Gpu("H100 SXM 80GB", 989.0, 80.0, 3350.0, 450.0, 50.0,
                "H100 SXM: 989 TFLOP/s bf16 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s; 400 Gbit/s NIC"),
    "h200": Gpu("H200 SXM 141GB", 989.0, 141.0, 4800.0, 450.0, 50.0,
                "H200 SXM: 989 TFLOP/s bf16 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 4 900 GB/s; 400 Gbit/s NIC"),
    "a100": Gpu("A100 SXM 80GB", 312.0, 80.0, 2039.0, 300.0, 25.0,
                "A100 80GB SXM: 312 TFLOP/s bf16 dense, 80 GB HBM2e at 2,039 GB/s, NVLink 3 600 GB/s; 200 Gbit/s NIC"),
    "l40s": Gpu("L40S 48GB", 362.0, 48.0, 864.0, 32.0, 12.5,
                "L40S: 362 TFLOP/s bf16 dense, 48 GB GDDR6 at 864 GB/s, no NVLink: PCIe 4.0 x16 64 GB/s; "
                "100 Gbit/s per GPU assumed"),
}


def gpu_preset(name: str, **overrides: float | None) -> Gpu:
    """The preset ``name`` with any of its figures replaced (None: kept); ValueError lists the known presets."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"unknown gpu {name!r}; the presets are {', '.join(GPUS)} (or override any figure with "
                         f"--tflops, --memory-gib, --memory-gbs, --intra-gbs, --inter-gbs)")
    given = {k: float(v) for k, v in overrides.items() if v is not None}
    for k, v in given.items():
        if k not in FIGURES:
            raise ValueError(f"no figure {k!r}; the figures are {', '.join(FIGURES)}")
        low, high, unit = RANGES[k]
        if not low <= v <= high:   # NaN too
            raise ValueError(f"--{k.replace('_', '-')} {v:g} is outside {low:,g} to {high:,g} {unit}")
    base = GPUS[key]

    def figure(k: str) -> float:
        return given.get(k, float(getattr(base, k)))
    return Gpu(base.name + (" (modified)" if given else ""), figure("tflops"), figure("memory_gib"),
               figure("memory_gbs"), figure("intra_gbs"), figure("inter_gbs"), base.source)


@dataclass(frozen=True)
class World:
    """``nodes`` x ``gpus_per_node`` ranks of one :class:`Gpu` kind."""

    nodes: int
    gpus_per_node: int
    gpu: Gpu

    def __post_init__(self) -> None:
        for k in ("nodes", "gpus_per_node"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be >= 1 (got {getattr(self, k)})")

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def dp_spans_nodes(self, pp: int, dp: int) -> bool:
        """Whether some position's data-parallel group (ranks p * dp .. p * dp + dp - 1) spans nodes."""
        return any(self.node(p * dp) != self.node(p * dp + dp - 1) for p in range(pp))

    def dp_bandwidth(self, pp: int, dp: int) -> float:
        """Bytes/s of the gradient all-reduce: the network's when a group spans nodes, else the node's links."""
        gbs = self.gpu.inter_gbs if self.dp_spans_nodes(pp, dp) else self.gpu.intra_gbs
        return gbs * 1e9

    def links(self, pp: int, dp: int) -> Links:
        """Per hop between positions h and h + 1 (and the wrap pp - 1 to 0): the slowest replica's bandwidth (the
        network's when the two ranks are on different nodes), latency 0 as with stated links (links.py)."""
        hops = 1 if pp <= 2 else pp
        bandwidth = []
        for h in range(hops):
            a, b = h, (h + 1) % pp
            apart = dp >= self.gpus_per_node or any(self.node(a * dp + r) != self.node(b * dp + r) for r in range(dp))
            bandwidth.append((self.gpu.inter_gbs if apart else self.gpu.intra_gbs) * 1e9)
        return Links((0.0,) * hops, tuple(bandwidth), "stated")
