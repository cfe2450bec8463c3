"""What :func:`leanact.patch` did to a model: the rows of ``leanact.summary(model)`` and its table."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import attention_hf

__all__ = ["PatchSummary", "off_reason"]


def off_reason(implementation: str) -> str:
    """Why a patched config's attention is not leanact's (summary row and warning)."""
    return (f"set to {implementation} after patching: leanact's attention is off (leanact.patch(model) or "
            f"model.set_attn_implementation(\"{attention_hf.NAME}\") brings it back)")


@dataclass
class PatchSummary:
    """What :func:`patch` did. ``replaced``/``left``: (qualified name, class, new class / reason)."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    left: list[tuple[str, str, str]] = field(default_factory=list)
    attention: list[tuple[str, str, str]] = field(default_factory=list)  # (model path, before, after/reason)
    #: model path -> run-time state; its ``fallbacks`` name the features (softcap, sinks, position_bias,
    #: ...) for which calls went to the original implementation instead of leanact's core.
    attention_states: dict = field(default_factory=dict, repr=False, compare=False)
    notes: list[str] = field(default_factory=list)  # whole-model changes (e.g. no KV cache in training)
    loss: list[tuple[str, str, str]] = field(default_factory=list)  # (model path, head, after/reason)
    #: model path -> :class:`leanact.patching.hf_head.HeadState`: fused calls so far and the operations
    #: for which the logits had to be materialised (the model's own loss then).
    loss_states: dict = field(default_factory=dict, repr=False, compare=False)
    #: model path -> (config set to leanact's attention, its row as patched; None: no row, a composite's top)
    attention_configs: dict = field(default_factory=dict, repr=False, compare=False)
    #: ``torch.nn.functional.dropout`` calls in modeling code (:mod:`leanact.patching.functional_dropout`):
    #: the classes whose forward calls it and how many calls kept a seed so far; None: no such class.
    functional_dropout: Any = field(default=None, compare=False)  # a functional_dropout.DropoutState

    def functional_dropout_row(self) -> tuple[str, str, str] | None:
        """(what, was, now) for the table: the wrapped classes and the calls redirected so far."""
        st = self.functional_dropout
        if st is None or not (st.classes or st.lean_calls or st.torch_calls):
            return None
        now = f"leanact seed: {st.lean_calls} calls so far"
        if st.torch_calls:
            now += f"; [yellow]torch's mask[/] for {st.torch_calls} (checkpointed or transformed regions)"
        where = ", ".join(st.classes) or "modules added after patching (PEFT)"
        return f"functional dropout in {where}", "F.dropout (mask)", now

    def attention_off(self) -> dict[str, str]:
        """model path -> the implementation set since patching where it is no longer leanact's (module doc)."""
        return {p: str(c._attn_implementation) for p, (c, _) in self.attention_configs.items()
                if c._attn_implementation != attention_hf.NAME}

    def refresh(self) -> "PatchSummary":
        """Bring the attention rows up to date with the configs (:meth:`attention_off`); returns self."""
        off = self.attention_off()
        for i, (path, before, _) in enumerate(self.attention):
            if path in self.attention_configs:
                now = f"left: {off_reason(off[path])}" if path in off else self.attention_configs[path][1]
                self.attention[i] = (path, before, now)
        return self

    def attention_fallbacks(self) -> dict[str, set]:
        """model path -> features seen so far that sent attention calls back to the original implementation."""
        return {p: set(st.fallbacks) for p, st in self.attention_states.items() if st.fallbacks}

    def left_in_layers(self) -> list[str]:
        """What was left inside the model's repeated layers (paths with a layer index), by name:
        "attention" if its row says left or calls fell back, then the classes of the modules left
        (RoPE tables excepted: built without autograd, they keep nothing); [] when nothing was."""
        import re

        self.refresh()
        out = []
        if any(after.startswith("left") for _, _, after in self.attention) or self.attention_fallbacks():
            out.append("attention")
        for name, cls, _ in self.left:
            if re.search(r"\.\d+(\.|$)", name) and not cls.endswith("RotaryEmbedding") and cls not in out:
                out.append(cls)
        return out

    def to_dict(self) -> dict:
        """Plain data (no markup) for JSON: every row of :meth:`table` by kind."""
        from rich.text import Text

        plain = lambda rows: [[Text.from_markup(x).plain for x in r] for r in rows]  # noqa: E731
        row = self.refresh().functional_dropout_row()
        return {"replaced": plain(self.replaced), "left": plain(self.left), "attention": plain(self.attention),
                "attention_fallbacks": {p: sorted(f) for p, f in self.attention_fallbacks().items()},
                "attention_off": self.attention_off(),
                "loss": plain(self.loss), "notes": list(self.notes),
                "functional_dropout": None if row is None else plain([row])[0],
                "left_in_layers": self.left_in_layers()}

    def table(self):
        """A rich Table of the replacements, what was left and why, and attention (``print()`` shows it)."""
        from leanact._format import text_table

        self.refresh()
        t = text_table(title="leanact.patch")
        for col in ("module", "was", "now / why left"):
            t.add_column(col)
        groups: dict[tuple[str, str, str], list[str]] = {}
        for name, old, new in self.replaced:
            groups.setdefault(("replaced", old, new), []).append(name)
        for name, old, why in self.left:
            groups.setdefault(("left", old, why), []).append(name)
        for (kind, old, what), names in groups.items():
            label = names[0] if len(names) == 1 else f"{len(names)} modules, e.g. {names[0]}"
            t.add_row(label, old, what if kind == "replaced" else f"[yellow]left[/]: {what}")
        fallbacks = self.attention_fallbacks()
        for path, before, after in self.attention:
            if path in fallbacks and not after.startswith("left"):
                after += f"; [yellow]{before}[/] for calls with {', '.join(sorted(fallbacks[path]))}"
            t.add_row(f"attention ({path or 'model'})", before, after)
        for path, before, after in self.loss:
            st = self.loss_states.get(path)
            if st is not None and st.fallbacks:
                after += f"; [yellow]logits materialised[/] for {', '.join(sorted(st.fallbacks))}"
            t.add_row(f"loss ({path or 'model'})", before, after)
        if (row := self.functional_dropout_row()) is not None:
            t.add_row(*row)
        for note in self.notes:
            t.add_row("model", "", note)
        return t
