"""`mixlen calibrate --model debug --out cost.json`: fit the cost model by timing the real model.

Times forward + backward of one whole sample at several lengths on this machine (one thread per
rank by default, as training runs), fits ``T(S) = a*S^2 + b*S + c`` by least squares weighted by
1/T (relative error: lengths span orders of magnitude), and writes a `mixlen-cost/1` file
(datapipe.cost). Byte sizes (K/V per token, activations) come from the model shape; link and host
bandwidths are given (defaults: the `cpu` device preset).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from datapipe.errors import ConfigError

DEFAULT_LENGTHS = "128,256,512,1024,2048,4096"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="debug", help="trainer model config name")
    parser.add_argument("--out", required=True, help="cost file to write (JSON)")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated lengths")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per length (min kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (as one rank)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"))
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--link-bytes-per-s",
        type=float,
        default=None,
        help="ring link bandwidth (default: the cpu device preset)",
    )
    parser.add_argument(
        "--offload-bytes-per-s",
        type=float,
        default=None,
        help="host link bandwidth (default: the cpu device preset)",
    )


def fit_cost(lengths: np.ndarray, times: np.ndarray) -> tuple[float, float, float]:
    """(a, b, c) >= 0 minimising sum(((a S^2 + b S + c) - T) / T)^2; a coefficient that comes
    out negative is fixed at 0 and the rest refitted."""
    s = np.asarray(lengths, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    cols = np.stack([s * s, s, np.ones_like(s)], axis=1)
    active = [0, 1, 2]
    coef = np.zeros(3)
    while active:
        w = 1.0 / t
        sol, *_ = np.linalg.lstsq(cols[:, active] * w[:, None], t * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return float(coef[0]), float(coef[1]), float(coef[2])


def time_model(
    model_name: str, lengths: list[int], repeats: int, dtype: str, device: str
) -> list[float]:
    """Min over `repeats` of one forward+backward of a whole random sample per length (s)."""
    import torch

    from trainer.executor import build_model
    from trainer.model import get_config

    dt = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[dtype]
    cfg = get_config(model_name)
    model, _ = build_model(cfg, dt, device, seed=0)
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).to(device)
        pos = torch.arange(n, device=device)
        best = float("inf")
        for i in range(repeats + 1):  # the first run warms up
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss, _ = model(ids, pos, labels=ids)
            loss.backward()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if i:
                best = min(best, time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        out.append(best)
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from datapipe.cost import DEVICES, CostModel
    from trainer.model import get_config

    try:
        lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(
            f"--lengths: expected comma-separated integers, got {args.lengths!r}"
        ) from None
    if len(lengths) < 3 or lengths[0] < 1:
        raise ConfigError("--lengths: need at least 3 distinct positive lengths to fit a, b, c")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    try:
        cfg = get_config(args.model)
    except ValueError as exc:
        raise ConfigError(f"--model: {exc}") from None
    torch.set_num_threads(max(1, args.threads))
    times = time_model(args.model, lengths, args.repeats, args.dtype, args.device)
    a, b, c = fit_cost(np.array(lengths), np.array(times))
    elt = {"float32": 4, "float64": 8, "bfloat16": 2}[args.dtype]
    dev = DEVICES["cpu"]
    model = CostModel(
        a=a,
        b=b,
        c=c,
        kv_bytes_per_token=float(2 * cfg.n_kv_heads * cfg.head_dim * elt * cfg.n_layers),
        link_bytes_per_s=args.link_bytes_per_s or dev.link_bytes_per_s,
        num_layers=cfg.n_layers,
        act_bytes_per_token_layer=float(17 * cfg.dim * elt),
        offload_bytes_per_s=args.offload_bytes_per_s or dev.offload_bytes_per_s,
        name=f"{args.model}@calibrated-{args.device}-{args.threads}t",
    )
    d = model.to_dict()
    pred = [a * n * n + b * n + c for n in lengths]
    d["calibration"] = {
        "lengths": lengths,
        "seconds": times,
        "fit_seconds": pred,
        "dtype": args.dtype,
        "threads": args.threads,
        "device": args.device,
    }
    with open(args.out, "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"{'length':>8} {'measured s':>11} {'fit s':>9}")
    for n, t, p in zip(lengths, times, pred):
        print(f"{n:>8} {t:>11.4f} {p:>9.4f}")
    print(f"a = {a:.4g} s/S^2, b = {b:.4g} s/token, c = {c:.4g} s  ->  {args.out}")
    return 0
