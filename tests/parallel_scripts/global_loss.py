"""One optimizer step of the Trainer on a fixed global batch of 8 rows whose answer spans have very
different lengths (SFT rows, and RL rows weighted by advantages), for one ``micro_batch_size x
grad_accum_steps`` split; the gradients at the accumulation boundary and the logged loss are
saved for the test to compare across splits, data-parallel sizes and a direct computation.

Run in-process (``measure``) or under torchrun (``fixtures.torchrun("global_loss", OUT,
"MICRO:ACCUM", ...)``: DP = 2, each rank reads its half; ``--context-parallel 2``: CP = 2, both
ranks read the whole batch and split each sequence). One launch measures every split it is given
on the same process groups and saves ``{(micro, accum): measure(...)}`` to OUT.
``--per-micro-batch`` averages every micro-batch by itself (what the trainer used to do).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from fixtures import resolved_recipe, trainer_for

ROWS = 8
ANSWER_LENGTHS = [1, 30, 2, 17, 3, 25, 1, 9]  # very different answer / response lengths
PROMPT_LENGTHS = [20, 3, 12, 8, 25, 4, 30, 10]
VOCAB = 128


CONVERSATIONS = [1, 3, 1, 2, 1, 1, 2, 1]  # SFT rows pack 1-3 conversations (an answer each)


def batch_rows(kind: str) -> list:
    """The 8 rows of the global batch, each a one-row layout (SFT conversations packed with their
    answer spans, or RL prompt + response with per-token advantages)."""
    from orthros_train.data.rl import rl_batch
    from orthros_train.phase import sft_layout

    g = torch.Generator().manual_seed(7)
    rows = []
    for i, (p, a) in enumerate(zip(PROMPT_LENGTHS, ANSWER_LENGTHS)):
        if kind == "rl":  # per-token advantages, two rows negative (sums that cancel would leave fp32 noise only)
            ids = torch.randint(0, VOCAB, (p + a,), generator=g)
            adv = (torch.rand(a, generator=g) * 2 + 0.1) * (-1 if i in (3, 6) else 1)
            rows.append(rl_batch([ids[:p]], [ids[p:]], [adv]))
            continue
        parts, spans, docs, start = [], [], [], 0
        for k in range(CONVERSATIONS[i]):  # later conversations of a row: other lengths again
            pk, ak = (p, a) if k == 0 else (3 + 2 * k, 1 + (a * (k + 1)) % 7)
            parts.append(torch.randint(0, VOCAB, (pk + ak,), generator=g))
            spans.append((start + pk, start + pk + ak))
            docs.append(torch.full((pk + ak,), k))
            start += pk + ak
        rows.append(sft_layout([torch.cat(parts)], [spans], document_ids=[torch.cat(docs)]))
    return rows


class FixedBatches:
    """The trainer's data interface over the fixed rows: this DP rank's half, in micro-batches."""

    def __init__(self, rows: list, micro: int, dp_rank: int, dp_size: int) -> None:
        per_rank = len(rows) // dp_size
        self.rows = rows[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        self.micro = micro
        self.cursor = 0

    def next_batch(self):
        from orthros_train.phase.layout import concat_layouts

        part = self.rows[self.cursor : self.cursor + self.micro]
        self.cursor += self.micro
        return concat_layouts(part)


def direct_loss(model, rows: list, loss_average: str) -> torch.Tensor:
    """The step's loss written out on the whole batch: a mean over all answer tokens, or over
    conversations / responses of their mean (float64 cross entropy of a single-device forward)."""
    import torch.nn.functional as F

    per_sequence = []
    for layout in rows:
        logits = model.forward_layout(layout).logits
        ce = F.cross_entropy(logits.double(), layout.labels, reduction="none") * layout.loss_weights.double()
        doc = layout.document_ids()[layout.output_index]
        per_sequence += [ce[doc == d] for d in torch.unique(doc)]
    if loss_average == "token":
        return torch.cat(per_sequence).sum() / sum(x.numel() for x in per_sequence)
    return torch.stack([x.mean() for x in per_sequence]).mean()


def build_trainer(run_dir: str, micro: int, accum: int, dp: int, cp: int = 1):
    from orthros_train.train.cli import launcher_env

    resolved = resolved_recipe(
        "tiny_cpu",
        "model.hidden_size=32", "model.num_hidden_layers=2", "model.intermediate_size=64", "model.sliding_window=8",
        "trainer.seq_len=64", f"trainer.micro_batch_size={micro}", f"trainer.grad_accum_steps={accum}",
        f"parallel.data_parallel={dp}", f"parallel.context_parallel={cp}", "parallel.zero_stage=0",
        "trainer.wandb.enabled=false", "trainer.progress=false", "trainer.resume=none", f"trainer.run_dir={run_dir}",
        "optim.warmup_steps=0",
    )  # fmt: skip
    return trainer_for(resolved, launcher_env() if dp * cp > 1 else None)


def measure(run_dir: str, micro: int, accum: int, per_micro_batch: bool = False, cp: int = 1) -> dict:
    """Gradients (engine names) and logged loss of one step, per batch kind and loss average, from
    the same initial weights; rank 0 also returns the direct computation's. The process groups
    stay up for the next measurement with the same layout (``destroy_parallel`` ends them)."""
    world = int(os.environ["WORLD_SIZE"]) if "TORCHELASTIC_RUN_ID" in os.environ else 1  # torchrun sets both
    dp = world // cp
    trainer = build_trainer(run_dir, micro, accum, dp, cp)
    try:
        return _measure(trainer, micro, dp, per_micro_batch)
    finally:
        trainer.close()  # its run lock: the next measurement in this process takes the same run directory


def _measure(trainer, micro: int, dp: int, per_micro_batch: bool) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from orthros_train.data.sft import average_per_sequence
    from orthros_train.train.global_loss import loss_units

    engine = trainer.engine
    module = engine.module
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    captured: dict[str, torch.Tensor] = {}
    real_step = engine.step

    def step_and_capture(*args, **kwargs):
        if engine.is_gradient_accumulation_boundary():
            captured.update({n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None})
        return real_step(*args, **kwargs)

    engine.step = step_and_capture
    if per_micro_batch:  # the old way: each micro batch averaged over its own tokens / sequences
        real_forward = engine.forward

        def own_average(layout, loss_normalizer=None, **kw):
            return real_forward(layout, loss_normalizer=loss_units(layout, trainer.cfg.data.loss_average), **kw)

        engine.forward = own_average
    out: dict = {}
    reference = trainer.reference_model().double()  # the initial weights on one device
    for kind in ("sft", "rl"):
        rows = batch_rows(kind)
        for average in ("token", "sequence"):
            with torch.no_grad():
                for n, p in module.named_parameters():
                    p.copy_(initial[n])
            trainer.cfg.data.loss_average = average
            weighted = [average_per_sequence(r) if average == "sequence" else r for r in rows]
            trainer.data = FixedBatches(weighted, micro, parallel_state.get_data_parallel_rank(), dp)
            captured.clear()
            stats = trainer.train_step()
            entry = {"loss": stats.loss, "grads": dict(captured)}
            if dist.get_rank() == 0 and not per_micro_batch:
                reference.zero_grad(set_to_none=True)
                want = direct_loss(reference, rows, average)
                want.backward()
                grads = {n: p.grad.float() for n, p in reference.named_parameters()}
                names = {n for n, _ in module.named_parameters()}
                # the engine's model has the reference parameter names (parallel/model.py builds
                # model/'s classes under them), so its gradients compare name by name
                assert names == set(grads), sorted(names ^ set(grads))[:5]
                engine_grads = grads
                entry["direct_loss"] = float(want)
                entry["direct_grads"] = {n: engine_grads[n] for n in names if n in engine_grads}
            out[(kind, average)] = entry
    return out


def main() -> None:
    from orthros_train.parallel.setup import destroy_parallel

    args = sys.argv[1:]
    cp = 1
    if "--context-parallel" in args:
        at = args.index("--context-parallel")
        cp = int(args[at + 1])
        del args[at : at + 2]
    per_micro_batch = "--per-micro-batch" in args
    out_path, *splits = [a for a in args if a != "--per-micro-batch"]
    run_dir = str(Path(out_path).parent / "run")
    result = {}
    for split in splits:
        micro, accum = (int(x) for x in split.split(":"))
        result[(micro, accum)] = measure(run_dir, micro, accum, per_micro_batch, cp)
    destroy_parallel()
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(result, out_path)


if __name__ == "__main__":
    main()
