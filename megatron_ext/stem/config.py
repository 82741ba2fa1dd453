"""STEM options (one dataclass; CLI flags map 1:1 onto its fields) and the layer-selection rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

RATIOS = ("1/3", "1/2", "full")
VARIANTS = ("up", "gate", "dagger")
# A STEM layer's "type" in the mlp_layers of an exported config.json (docs/convert.md), which
# the stem-edit tool (convert/stem_edit.py) reads.
HF_MLP_TYPE = "stem"
INITS = ("normal", "fan-in", "ones", "zeros")
PLACEMENTS = ("gpu", "cpu", "tiered")  # tiered: stem/runtime/tiers.py
SHARDINGS = ("replicated", "vocab")
# --stem-tier-count-tokens: 134M tokens, about 0.6 s of counting per rank on the development
# machine (stem/runtime/hot_rows.py)
DEFAULT_TIER_COUNT_TOKENS = 1 << 27
OWNERSHIPS = ("interleaved", "contiguous")  # stem/runtime/ownership.py; interleaved measured balanced
OPTIMIZERS = ("dense", "sparse")            # stem/runtime/row_adam.py
KERNELS = ("auto", "triton", "torch")       # kernels/stem_gate.py
COMPILES = ("none", "gate")                 # kernels/stem_gate.py gate_product, megatron_ext/compiled.py
HOST_READS = ("staged", "direct")           # stem/runtime/store.py, kernels/host_rows.py
GPU_STEPS = ("torch", "triton")             # stem/runtime/row_adam.py, kernels/row_adam_gpu.py


@dataclass
class StemConfig:
    """Options of the STEM family.

    ratio:   which layers become STEM layers when ``layers`` is not given (Sec. 4.4.1 of the paper):
             ``1/3`` -> layers i with (i+1) % 3 == 0, ``1/2`` -> (i+1) % 2 == 0, ``full`` -> all
             but layer 0. Layer numbers here are 0-based.
    layers:  an explicit list of 0-based layer indices; wins over ``ratio``. Layer 0 is refused.
    variant: ``up`` (Eq. 4: the table replaces W_up), ``gate`` (the ablation of Sec. 4.4.2: the
             table replaces W_gate, y = W_d(act(U[t]) * W_up x)), ``dagger`` (Eq. 5: W_up is kept and
             U[t] is added to its output).
    init:    table initialisation. ``normal``: N(0, init_method_std^2), Megatron's rule for
             embeddings. ``fan-in`` (default): N(0, (init_method_std * sqrt(hidden))^2), the spread
             of W_up x at initialisation for unit-RMS x, so a STEM layer starts with the output scale
             of the dense layer it replaces. ``ones``: U[t] = 1, the layer starts as act(W_g x).
             ``zeros``: the default for mid-training insertion with ``dagger`` (starts equal to the
             dense layer); refused for ``up``/``gate``, where it would zero the gradient of W_g.
    """

    ratio: str = "1/3"
    layers: Optional[List[int]] = None
    variant: str = "up"
    init: str = "fan-in"
    # Where the tables live and who steps them (issue "STEM tables at scale", docs/stem.md):
    # placement gpu + sharding replicated is an ordinary parameter (Megatron's DDP and optimizer);
    # every other combination is a managed table (stem/runtime/tables.py, stem/runtime/optimizer.py).
    placement: str = "gpu"
    sharding: str = "replicated"
    ownership: str = "interleaved"
    optimizer: str = "dense"
    prefetch: bool = True
    # tiered placement: rows of the GPU tier, "10%" / "0.1" (of the vocabulary) or a row count.
    gpu_tier: str = "10%"
    # Tokens of the training data counted to choose the GPU tier (0: all; stem/runtime/hot_rows.py).
    tier_count_tokens: int = DEFAULT_TIER_COUNT_TOKENS
    # The lookup-and-gate: ``triton`` the fused kernel (kernels/stem_gate.py), ``torch`` its
    # plain-PyTorch reference, ``auto`` the PyTorch path (faster on an H100: stem_gate.resolve).
    kernel: str = "auto"
    # The PyTorch path's ops after the gather (cast, activation, product): ``gate`` compiled
    # (torch.compile), ``none`` eager; none until a GPU run measures both (benchmarks/stem_mlp.py).
    compile: str = "none"
    # Host-resident rows (shards and moments) on transparent huge pages (stem/runtime/host_memory.py).
    host_huge_pages: bool = True
    # How host rows reach the GPU: ``staged`` (gathered on the CPU into pinned staging, then
    # copied) or ``direct`` (a GPU kernel reads them from page-locked host shards); staged
    # until a GPU run measures both (benchmarks/stem_host_read.py).
    host_read: str = "staged"
    # The sparse optimizer's step of the rows on the GPU (tiered's GPU tier, gpu placement):
    # ``torch`` (about 28 ops per chunk of rows) or ``triton`` (one kernel,
    # kernels/row_adam_gpu.py); torch until a GPU run measures both.
    gpu_step: str = "torch"

    @property
    def managed_tables(self) -> bool:
        return not (self.placement == "gpu" and self.sharding == "replicated")

    def __post_init__(self) -> None:
        if self.ratio not in RATIOS:
            raise ValueError(f"--stem-ratio={self.ratio!r}: allowed values are {', '.join(RATIOS)}")
        if self.variant not in VARIANTS:
            raise ValueError(
                f"--stem-variant={self.variant!r}: allowed values are {', '.join(VARIANTS)}")
        if self.init not in INITS:
            raise ValueError(f"--stem-init={self.init!r}: allowed values are {', '.join(INITS)}")
        if self.init == "zeros" and self.variant != "dagger":
            raise ValueError(
                f"--stem-init=zeros with --stem-variant={self.variant}: a zero table makes the "
                "STEM layer output zero and its gate untrainable; zeros is only allowed for dagger")
        for flag, value, allowed in (("--stem-table-placement", self.placement, PLACEMENTS),
                                     ("--stem-table-sharding", self.sharding, SHARDINGS),
                                     ("--stem-row-ownership", self.ownership, OWNERSHIPS),
                                     ("--stem-optimizer", self.optimizer, OPTIMIZERS),
                                     ("--stem-kernel", self.kernel, KERNELS),
                                     ("--stem-compile", self.compile, COMPILES),
                                     ("--stem-host-read", self.host_read, HOST_READS),
                                     ("--stem-gpu-step", self.gpu_step, GPU_STEPS)):
            if value not in allowed:
                raise ValueError(f"{flag}={value!r}: allowed values are {', '.join(allowed)}")
        if self.tier_count_tokens < 0:
            raise ValueError(f"--stem-tier-count-tokens={self.tier_count_tokens}: must be >= 0 "
                             "(0 counts every token)")
        if self.placement == "tiered" and self.sharding != "vocab":
            raise ValueError("--stem-table-placement tiered: both tiers are sharded by "
                             "vocabulary over the data-parallel ranks; pass "
                             "--stem-table-sharding vocab")
        if self.gpu_step == "triton" and (self.optimizer != "sparse"
                                          or self.placement == "cpu"):
            raise ValueError("--stem-gpu-step triton steps the sparse optimizer's rows on the "
                             "GPU: it needs --stem-optimizer sparse and --stem-table-placement "
                             "tiered or gpu (managed); or pass --stem-gpu-step torch")
        if self.host_read == "direct" and self.placement == "gpu":
            raise ValueError("--stem-host-read direct reads host rows, and "
                             "--stem-table-placement gpu keeps none: use --stem-table-placement "
                             "cpu or tiered, or --stem-host-read staged")
        if self.layers is not None:
            layers = list(self.layers)
            if not layers:
                raise ValueError("--stem-layers: the list is empty; omit the flag to use --stem-ratio")
            if len(set(layers)) != len(layers):
                raise ValueError(f"--stem-layers={format_layers(layers)}: layers are repeated")
            if 0 in layers:
                raise ValueError(
                    f"--stem-layers={format_layers(layers)}: layer 0 is never a STEM layer "
                    "(it processes the raw token embeddings; Sec. 4.1 of the paper)")
            if any(i < 0 for i in layers):
                raise ValueError(f"--stem-layers={format_layers(layers)}: layer indices are >= 1")
            self.layers = sorted(layers)

    def stem_layers(self, num_layers: int) -> List[int]:
        """0-based indices of the STEM layers of a ``num_layers``-layer model."""
        return select_stem_layers(num_layers, self.ratio, self.layers)


def parse_layers(text: str) -> List[int]:
    """Parse ``"2,5,8"`` into ``[2, 5, 8]`` with a message that names the flag."""
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise ValueError(
            f"--stem-layers={text!r}: expected a comma-separated list of layer indices, e.g. 2,5,8"
        ) from None


def format_layers(layers: Sequence[int]) -> str:
    return ",".join(str(i) for i in layers)


def select_stem_layers(num_layers: int, ratio: str = "1/3",
                       layers: Optional[Sequence[int]] = None) -> List[int]:
    """The paper's layer-selection rule (0-based layer indices); an explicit list wins."""
    if num_layers < 1:
        raise ValueError(f"--num-layers={num_layers}: a model needs at least one layer")
    if layers is not None:
        bad = [i for i in layers if i < 1 or i >= num_layers]
        if bad:
            raise ValueError(
                f"--stem-layers={format_layers(layers)}: {format_layers(bad)} out of range; STEM "
                f"layers must be in 1..{num_layers - 1} for --num-layers={num_layers}")
        return sorted(layers)
    if ratio == "1/3":
        return [i for i in range(1, num_layers) if (i + 1) % 3 == 0]
    if ratio == "1/2":
        return [i for i in range(1, num_layers) if (i + 1) % 2 == 0]
    if ratio == "full":
        return list(range(1, num_layers))
    raise ValueError(f"--stem-ratio={ratio!r}: allowed values are {', '.join(RATIOS)}")
