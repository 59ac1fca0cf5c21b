"""Every tensor of a checkpoint trained in the benchmark: ZipNN against ours, one core each.

    pip install -e '.[bench]'       # zipnn
    flock -x /work/helpers/machine.lock python benchmarks/compression_trained.py
    python benchmarks/compression_trained.py --compact    # ours: WeightCodec(compact=True)

No download: the script trains a small causal transformer language model (vocabulary
512, width 256, 2 pre-norm layers of 4 heads, feed-forward 1024, context 64; 1.9M
parameters, tied embedding) for ``--steps`` AdamW steps (lr 3e-3, weight decay 0.01,
batch 16, seed 0, one thread) on synthetic but learnable text: sequences from a fixed
random order-2 Markov chain whose next token is one of 4 likely successors. The loss
falls from ln(512) ~ 6.2 to about 1.5; the script prints it. What a mixed-precision
trainer keeps is then compared, tensor by tensor: the fp32 master weights
(``w32``), their bf16 copies (``w16``), and AdamW's fp32 ``exp_avg`` (``m``) and
``exp_avg_sq`` (``v``).

Both sides as a user would call them: ZipNN 0.5.4 ``ZipNN(input_format="byte",
bytearray_dtype=<dtype>, threads=1)`` (method AUTO, its default 256 KiB chunks), and
ours ``[WeightCodec()]`` (``--compact``: ``compact=True``) through the framework
(``encoding_stream`` into a sink, ``ExtensionRegistry.decoding_stream`` read into a
preallocated buffer). Ratio is
logical / stored bytes. Decompression: one thread on both sides, warm (one untimed
run first), the best of ``--repeat`` runs of each, every decode checked byte for byte.
The totals row sums bytes and the best times over every tensor.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.compression import MB, Codec, ours, stored_size, zipnn  # noqa: E402
from extensions import ItemInfo, WeightCodec  # noqa: E402

VOCAB, WIDTH, LAYERS, HEADS, FF, CONTEXT, BATCH = 1024, 256, 2, 4, 1024, 32, 8


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        self.position = torch.nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(
            WIDTH, HEADS, FF, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.layers = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(WIDTH)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(CONTEXT)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        x = self.layers(x, mask=self.mask, is_causal=True)
        return self.norm(x) @ self.embed.weight.T


def markov_batches(gen: torch.Generator) -> Any:
    """Sequences of a Markov chain: each token has 4 likely successors (probabilities
    0.55, 0.25, 0.12, 0.08), fixed by the seed; the best loss is their entropy, 1.1."""
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=gen)
    weights = torch.tensor([0.55, 0.25, 0.12, 0.08])
    while True:
        picks = torch.multinomial(weights, BATCH * CONTEXT, replacement=True, generator=gen)
        picks = picks.view(BATCH, CONTEXT)
        seq = torch.empty(BATCH, CONTEXT + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=gen)
        for t in range(CONTEXT):
            seq[:, t + 1] = successors[seq[:, t], picks[:, t]]
        yield seq[:, :-1], seq[:, 1:]


def train(steps: int) -> dict[str, torch.Tensor]:
    """What a mixed-precision trainer keeps after ``steps`` steps, by name."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same floating-point sums on every machine
    try:
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        batches = markov_batches(gen)
        start = time.perf_counter()
        for step in range(steps):
            tokens, targets = next(batches)
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step in (0, steps - 1):
                print(f"step {step}: loss {loss.item():.3f}", file=sys.stderr)
        count = sum(p.numel() for p in model.parameters())
        print(
            f"trained {count / 1e6:.2f}M parameters for {steps} steps "
            f"in {time.perf_counter() - start:.1f} s",
            file=sys.stderr,
        )
    finally:
        torch.set_num_threads(threads)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        out[f"{name} w32"] = p.detach().clone()
        out[f"{name} w16"] = p.detach().to(torch.bfloat16)
        out[f"{name} m"] = state["exp_avg"].clone()
        out[f"{name} v"] = state["exp_avg_sq"].clone()
    return out


def best_decompress(codec: Codec, stored: Any, raw: bytes, repeat: int) -> float:
    decompress = codec[1]
    best = float("inf")
    for run in range(repeat + 1):
        start = time.perf_counter()
        plain = decompress(stored, len(raw))  # type: ignore[call-arg]
        took = time.perf_counter() - start
        if bytes(plain) != raw:
            raise SystemExit("decoded bytes differ from the original")
        if run:  # the first run warms up
            best = min(best, took)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--compact", action="store_true", help="ours as WeightCodec(compact=True)")
    args = parser.parse_args()
    state = train(args.steps)
    torch.set_num_threads(1)
    columns = ["tensor", "dtype", "KB", "ratio ZipNN", "ratio ours", "ours/ZipNN"]
    columns += ["dec MB/s ZipNN", "dec MB/s ours", "ours/ZipNN"]
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    totals = {"raw": 0, "zipnn": 0, "ours": 0, "tz": 0.0, "to": 0.0}
    worst_ratio: tuple[float, str] = (float("inf"), "")
    worst_speed: tuple[float, str] = (float("inf"), "")
    for name, tensor in state.items():
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        dtype = str(tensor.dtype).removeprefix("torch.")
        item = ItemInfo(checkpoint="bench", item=name, dtype=dtype, element_size=tensor.itemsize)
        theirs, mine = zipnn(dtype), ours([WeightCodec(compact=args.compact)], item)
        stored_z = theirs[0](bytearray(raw))  # ZipNN reorders its input in place
        stored_o = mine[0](raw)
        size_z, size_o = stored_size(stored_z), stored_size(stored_o)
        tz = best_decompress(theirs, stored_z, raw, args.repeat)
        to = best_decompress(mine, stored_o, raw, args.repeat)
        gain, speed = size_z / size_o, tz / to
        worst_ratio = min(worst_ratio, (gain, name))
        worst_speed = min(worst_speed, (speed, name))
        for key, value in (
            ("raw", len(raw)),
            ("zipnn", size_z),
            ("ours", size_o),
            ("tz", tz),
            ("to", to),
        ):
            totals[key] += value
        print(
            f"| {name} | {dtype} | {len(raw) / 1e3:.1f} | {len(raw) / size_z:.4f} | "
            f"{len(raw) / size_o:.4f} | {gain:.4f} | {len(raw) / MB / tz:.0f} | "
            f"{len(raw) / MB / to:.0f} | {speed:.2f} |",
            flush=True,
        )
    raw_total = totals["raw"]
    print(
        f"| all {len(state)} tensors | | {raw_total / 1e3:.0f} | "
        f"{raw_total / totals['zipnn']:.4f} | "
        f"{raw_total / totals['ours']:.4f} | {totals['zipnn'] / totals['ours']:.4f} | "
        f"{raw_total / MB / totals['tz']:.0f} | {raw_total / MB / totals['to']:.0f} | "
        f"{totals['tz'] / totals['to']:.2f} |"
    )
    print(
        f"\nworst ratio, ours/ZipNN stored bytes inverted: {worst_ratio[0]:.4f} ({worst_ratio[1]})"
    )
    print(f"worst decompression speed, ours/ZipNN: {worst_speed[0]:.2f} ({worst_speed[1]})")
    ratio_met = worst_ratio[0] >= 1.0
    speed_met = totals["tz"] / totals["to"] >= 1.0
    print(f"goal ratio >= ZipNN on every tensor: {'met' if ratio_met else 'NOT met'}")
    print(
        "goal decompression >= ZipNN per core (all tensors together): "
        f"{'met' if speed_met else 'NOT met'} ({totals['tz'] / totals['to']:.2f}x)"
    )


if __name__ == "__main__":
    main()
