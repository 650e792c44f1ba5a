"""The one structure that carries a batch through the stack: base tokens + output plan.

The base stream is every input token (packed, varlen, with positions and
document ids); the output stream is a sorted list of positions that must predict a token, each
with a label and a loss weight. Every phase (pretrain, sft, rl, prefill, decode) is a builder in
``orthros_train/phase/builders.py`` that produces an ``OrthrosLayout``.

Everything is packed along one token dimension: several rows of a ``[B, T]`` batch become one
sequence whose documents never attend each other, so the attention op sees no padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

IGNORE_INDEX = -100


@dataclass
class OrthrosLayout:
    """A packed batch.

    input_ids      [T]   base token ids
    positions      [T]   RoPE position of each base token (restarts at 0 in each document)
    cu_seqlens     [D+1] document boundaries along T (int32, 0 .. T)
    output_index   [N]   sorted indices into T of the tokens that get an output token
    labels         [N]   target token of each output token (IGNORE_INDEX: no loss)
    loss_weights   [N]   per-output-token weight (1 for pretrain/sft, advantages for rl)
    row_of_output  [N]   which ``[B, T]`` row an output token came from (to unpack logits)
    num_rows             B
    output_values  name -> [N]  further per-output-token values an objective reads beside the
                         labels (RL: the sampling policy's and the reference's log-probs)
    row_values     name -> B numbers per row, for an objective's diagnostics (RL: each rollout's reward)
    base_global    [T] bool, or None: the base tokens whose query sees its whole document instead of
                   the window (a prompt's global tail, ``ops/keys.py``); None: no such token
    answers        the output tokens are answers a generation produces (SFT, RL): a model with a
                   global tail derives its global tokens from them (``keys.answer_tail_flags``)

    Every phase returns this one type (RL's rollouts included), so the trainer's step reads the
    same batch whatever the objective.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    output_index: torch.Tensor
    labels: torch.Tensor
    loss_weights: torch.Tensor
    row_of_output: torch.Tensor
    num_rows: int = 1
    output_values: dict[str, torch.Tensor] = field(default_factory=dict)
    row_values: dict[str, list[float]] = field(default_factory=dict)
    base_global: torch.Tensor | None = None
    answers: bool = False
    # Labelled output tokens, counted once by ``validate`` (on the host, where layouts are built):
    # a count on the device would make every forward wait for the GPU.
    num_loss_tokens: int = field(init=False, default=0)
    # Global base tokens (``base_global``), counted on the host too: the kernels' plan needs the
    # number of windowed queries without a device sync.
    num_global: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_outputs(self) -> int:
        return self.output_index.numel()

    def validate(self) -> None:
        t = self.input_ids.numel()
        n = self.output_index.numel()
        self.num_loss_tokens = int((self.labels != IGNORE_INDEX).sum()) if self.labels.dim() == 1 else 0
        if t == 0:
            raise ValueError("empty layout: a batch needs at least one base token")
        if self.base_global is not None:
            if self.base_global.dtype != torch.bool or tuple(self.base_global.shape) != (t,):
                raise ValueError(f"layout.base_global must be a bool [{t}] tensor, got "
                                 f"{self.base_global.dtype} {tuple(self.base_global.shape)}")
            self.num_global = int(self.base_global.sum())
        for name in ("input_ids", "positions", "output_index", "labels", "loss_weights"):
            if getattr(self, name).dim() != 1:
                raise ValueError(f"layout.{name} must be 1-D (packed), got {getattr(self, name).dim()}-D")
        if self.positions.numel() != t:
            raise ValueError(f"layout.positions has {self.positions.numel()} entries, expected {t}")
        for name in ("labels", "loss_weights", "row_of_output"):
            if getattr(self, name).numel() != n:
                raise ValueError(f"layout.{name} has {getattr(self, name).numel()} entries, expected {n}")
        for name, values in self.output_values.items():
            if values.dim() != 1 or values.numel() != n:
                raise ValueError(f"layout.output_values[{name!r}] has shape {tuple(values.shape)}, expected ({n},)")
        for name, values in self.row_values.items():
            if len(values) != self.num_rows:
                raise ValueError(f"layout.row_values[{name!r}] has {len(values)} entries for {self.num_rows} rows")
        cu = self.cu_seqlens
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != t:
            raise ValueError(f"layout.cu_seqlens must run from 0 to {t}")
        if bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError("layout.cu_seqlens must be strictly increasing (no empty documents)")
        if n:
            if bool((self.output_index[1:] <= self.output_index[:-1]).any()):
                raise ValueError("layout.output_index must be sorted and unique")
            if int(self.output_index[0]) < 0 or int(self.output_index[-1]) >= t:
                raise ValueError(f"layout.output_index must lie in [0, {t})")

    def to(self, device: torch.device | str) -> "OrthrosLayout":
        """The same layout on ``device``. Not validated again: this one was validated when it
        was built (on the host, where the checks are free), and on a GPU every check would
        wait for the device."""
        moved = object.__new__(OrthrosLayout)
        for f in fields(self):
            value = getattr(self, f.name)
            setattr(moved, f.name, value.to(device) if isinstance(value, torch.Tensor) else value)
        moved.output_values = {k: v.to(device) for k, v in self.output_values.items()}
        moved.row_values = {k: list(v) for k, v in self.row_values.items()}
        return moved

    def document_ids(self) -> torch.Tensor:
        """[T] index of the document each base token belongs to."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


def concat_layouts(layouts: list[OrthrosLayout]) -> OrthrosLayout:
    """Pack several layouts into one (rows stay separate documents). Their ``output_values`` and
    ``row_values`` are packed too; a name must be present in every layout or in none."""
    if not layouts:
        raise ValueError("concat_layouts needs at least one layout")
    for attr in ("output_values", "row_values"):
        names = {frozenset(getattr(lay, attr)) for lay in layouts}
        if len(names) > 1:
            raise ValueError(f"concat_layouts: the layouts' {attr} carry different names {sorted(map(sorted, names))}")
    offset, row_offset = 0, 0
    cu, out_idx, rows = [layouts[0].cu_seqlens[:1]], [], []
    for lay in layouts:
        cu.append(lay.cu_seqlens[1:] + offset)
        out_idx.append(lay.output_index + offset)
        rows.append(lay.row_of_output + row_offset)
        offset += lay.num_tokens
        row_offset += lay.num_rows
    return OrthrosLayout(
        input_ids=torch.cat([x.input_ids for x in layouts]),
        positions=torch.cat([x.positions for x in layouts]),
        cu_seqlens=torch.cat(cu).to(torch.int32),
        output_index=torch.cat(out_idx),
        labels=torch.cat([x.labels for x in layouts]),
        loss_weights=torch.cat([x.loss_weights for x in layouts]),
        row_of_output=torch.cat(rows),
        num_rows=row_offset,
        output_values={k: torch.cat([x.output_values[k] for x in layouts]) for k in layouts[0].output_values},
        row_values={k: [v for x in layouts for v in x.row_values[k]] for k in layouts[0].row_values},
        base_global=_concat_flags([x.base_global for x in layouts], [x.num_tokens for x in layouts]),
        answers=_all_or_none([x.answers for x in layouts]),
    )


def _all_or_none(answers: list[bool]) -> bool:
    if len(set(answers)) > 1:
        raise ValueError("concat_layouts: answer layouts (SFT/RL) and others cannot be packed together")
    return answers[0]


def _concat_flags(flags: list[torch.Tensor | None], lengths: list[int]) -> torch.Tensor | None:
    """The packed ``base_global`` of several layouts (None where none has a global token)."""
    given = [f for f in flags if f is not None]
    if not given:
        return None
    return torch.cat([torch.zeros(n, dtype=torch.bool, device=given[0].device) if f is None else f.bool()
                      for f, n in zip(flags, lengths)])
