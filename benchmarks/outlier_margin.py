"""How close honest replicas come to the outlier rule's factor with the sparse codec, when a restore clears one
replica's residual (``rendezvous/robust.py``, ``rendezvous/feedback.py``).

    python benchmarks/outlier_margin.py --out bench-out/outlier-margin
    python benchmarks/outlier_margin.py --out bench-out/outlier-margin --rounds 200 --density 0.015

With error feedback (``resend``) a replica sends ``C(delta + e)``: the norm the rule judges is that of
``delta + e``, and ``e`` grows over the first rounds until what the codec sends each round balances what
joins it. A replica whose residual a restore cleared (it loaded a published state without its own) sends
``delta`` alone, a smaller norm; in a quorum where such replicas are the lower median, the long-running
replicas are judged against it. This measures the ratio the rule compares with the factor: each honest
norm over the lower median of the round's non-zero norms, for 4 replicas of which ``--restored`` have their
residual cleared at round ``--restore-at``, and for the quorum of the first 3 (one of them restored).

The pseudo-gradients are synthetic, not a model's: per coordinate a scale drawn log-normally (weights of very
different sizes, as in a transformer), a direction shared by the replicas that drifts from round to round,
and each replica's own noise of the same size; the real sparse codec (``sparse.compress``/``expand``) at the
run's density. Writes ``results.json``: per round the ratios, and the largest ratio seen and its round.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from composer_serverless.rendezvous.sparse import Sparse, compress, expand


def lower_median_ratio(norms: list[float]) -> list[float]:
    """Each norm over the lower median of the non-zero ones (what ``robust.outliers`` compares with)."""
    reference = statistics.median_low([n for n in norms if n > 0])
    return [n / reference for n in norms]


def simulate(args: argparse.Namespace) -> dict[str, object]:
    generator = torch.Generator().manual_seed(args.seed)
    codec = Sparse(args.density)
    scale = torch.exp(torch.randn(args.numel, generator=generator) * args.log_scale_spread)
    shared = torch.randn(args.numel, generator=generator)
    residuals = [torch.zeros(args.numel) for _ in range(args.replicas)]
    restored = set(range(args.replicas - args.restored, args.replicas))
    rounds = []
    for round_index in range(1, args.rounds + 1):
        if round_index == args.restore_at:
            for r in restored:
                residuals[r].zero_()
        shared = args.drift_keep * shared + (1 - args.drift_keep**2) ** 0.5 * torch.randn(
            args.numel, generator=generator
        )
        norms = []
        for r in range(args.replicas):
            delta = scale * (shared + torch.randn(args.numel, generator=generator))
            sending = delta + residuals[r]
            norms.append(float(sending.norm()))
            sent = expand(compress(sending, codec), codec, args.numel)
            residuals[r] = sending - sent
        rounds.append(
            {
                "round": round_index,
                "norms": norms,
                "ratios_all": lower_median_ratio(norms),
                "ratios_first3": lower_median_ratio(norms[:3]),
            }
        )
    after = [row for row in rounds if row["round"] >= args.restore_at]
    worst_all = max(after, key=lambda row: max(row["ratios_all"]))
    worst_3 = max(after, key=lambda row: max(row["ratios_first3"]))
    steady = [row for row in rounds if row["round"] < args.restore_at]
    return {
        "settings": vars(args) | {"out": str(args.out)},
        "steady_ratio_max": max(max(row["ratios_all"]) for row in steady) if steady else None,
        "after_restore_ratio_max_all": max(worst_all["ratios_all"]),
        "after_restore_ratio_max_all_round": worst_all["round"],
        "after_restore_ratio_max_first3": max(worst_3["ratios_first3"]),
        "after_restore_ratio_max_first3_round": worst_3["round"],
        "residual_growth": rounds[args.restore_at - 2]["norms"][0] / rounds[0]["norms"][0]
        if args.restore_at >= 2
        else None,
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--numel", type=int, default=1 << 18)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--restored", type=int, default=2, help="replicas whose residual the restore clears")
    parser.add_argument("--restore-at", type=int, default=60)
    parser.add_argument("--density", type=float, default=0.015)
    parser.add_argument("--log-scale-spread", type=float, default=1.0)
    parser.add_argument("--drift-keep", type=float, default=0.9, help="correlation of the shared direction")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = simulate(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
