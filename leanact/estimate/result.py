"""The :class:`Estimate` returned by :func:`leanact.estimate`."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from leanact._format import format_bytes

__all__ = ["Estimate", "fmt_bytes"]


fmt_bytes = format_bytes


@dataclass
class Estimate:
    """Predicted memory of one training step (bytes).

    per_layer: per repeated block, bytes kept for backward (as :class:`leanact.memory.SavedTensorMeter`
        counts them: distinct storages, parameters excluded). per_layer_alive: activation bytes
        the block's forward left alive (includes its output; counts layer inputs kept by a full
        recompute, which the meter does not see). saved_by_module: bytes kept for backward by each
        module that saved them (the meter's ``by_module``: qualified names, ``name/fn`` for functional
        calls inside a module; every byte of ``saved`` once), for the bytes of a part of the model.
    activations: activation bytes alive at the end of the forward (incl. the loss computation):
        all that is kept for backward plus the outputs. saved: the meter's total.
    weight_copies: of ``saved``, autocast's 16-bit copies of fp32 weights (batch-independent; 0
        without autocast, and for Linears patched by ``leanact.patch``, which recast in backward).
    autocast: the autocast dtype the forward ran under ("bfloat16", "float16"), or None.
    params (+ buffers), grads (all trainable parameters), optimizer_state: their full sizes.
    workspaces: (CUDA) what the runtime keeps allocated across steps and so adds to every moment of
        the step: cuBLAS / cuBLASLt workspaces of the threads that run matmuls, leanact's device
        lookup tables (:mod:`leanact.estimate.cuda_runtime`); ``workspace_items``: by item. 0 on the CPU.
    temporaries: the rest of the peak (gradients of activations, op workspaces, the inputs).
    peak: largest total on the compute device during forward, backward and optimizer step;
        at_peak: its breakdown.
    host: host memory the offload strategies' pool needs (pinned on CUDA; its own peak, not part
        of ``peak``); 0 without offload.
    """

    device: str
    dtype: str
    per_layer: dict[str, int]
    per_layer_alive: dict[str, int]
    activations: int
    saved: int
    params: int
    buffers: int
    grads: int
    optimizer_state: int
    temporaries: int
    peak: int
    at_peak: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    weight_copies: int = 0
    autocast: str | None = None
    workspaces: int = 0
    workspace_items: dict[str, int] = field(default_factory=dict)
    host: int = 0
    saved_by_module: dict[str, int] = field(default_factory=dict)

    def saved_under(self, prefix: str) -> int:
        """Bytes kept for backward by the module named ``prefix`` and its submodules (a vision tower:
        ``"model.visual"``; ``""``: the whole model, ``saved``)."""
        prefix = prefix.rstrip(".")
        if not prefix:
            return sum(self.saved_by_module.values())
        return sum(n for name, n in self.saved_by_module.items()
                   if name == prefix or name.startswith(prefix + ".") or name.startswith(prefix + "/"))

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self, title: str | None = None):
        """A rich Table: the per-layer kept bytes, then the step's totals (``print()`` shows it)."""
        from leanact._format import text_table

        amp = f", autocast {self.autocast}" if self.autocast else ""
        tab = text_table(title=title or f"leanact.estimate ({self.device}, {self.dtype}{amp})")
        tab.add_column("item")
        tab.add_column("bytes", justify="right")
        tab.add_column("", justify="right")
        for name, n in self.per_layer.items():
            tab.add_row(f"layer {name} (kept for backward)", f"{n:,}", fmt_bytes(n))
        for label, n in (("parameters + buffers", self.params + self.buffers), ("gradients", self.grads),
                         ("optimizer state", self.optimizer_state), ("activations (end of forward)", self.activations),
                         ("  of which kept for backward", self.saved),
                         *((("    of which autocast weight copies", self.weight_copies),)
                           if self.weight_copies else ()),
                         *((("CUDA workspaces (held across steps)", self.workspaces),) if self.workspaces else ()),
                         ("temporaries at peak", self.temporaries)):
            tab.add_row(label, f"{n:,}", fmt_bytes(n))
        tab.add_row("peak", f"{self.peak:,}", fmt_bytes(self.peak), style="bold")
        if self.host:
            tab.add_row("host memory (offload pool)", f"{self.host:,}", fmt_bytes(self.host))
        return tab
