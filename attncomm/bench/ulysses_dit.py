"""``attncomm bench ulysses --dit-model``: one diffusion transformer — diffusers' Flux
(``FluxTransformer2DModel``, built from its config with random weights from a fixed seed) —
sharded over W ranks two ways on the same model and input:

- ``attncomm``: ``FluxUlyssesProcessor`` (``demo/models/flux.py``): each rank holds its image
  tokens (``head_split(S_img, W)``) and every text token; each block's attention is
  ``UlyssesAttention`` with the text tokens as joint rows (kept out of the exchange); the
  output is gathered at the end so every rank holds it all. ``attncomm fp8`` adds the FP8
  payload.
- ``diffusers_cp``: diffusers' own context parallelism, ``ContextParallelConfig(ulysses_degree
  = W)``: its plan splits the image and the text tokens along the sequence, each attention is
  an all-to-all of q, k, v (torch's functional ``all_to_all_single``) and one back, and the
  output is gathered at ``proj_out``.

Each is timed as one model forward that starts from the full inputs on every rank and ends with
the full output on every rank (slowest rank's median, a barrier before every iteration), beside
``one_process`` (the model alone, every rank running it whole), and checked against it (min
cosine per token over the output channels, max abs error).

diffusers' ``enable_parallelism`` cannot run on a CPU-only torch: it puts rank r on
``torch.device(accelerator, r % torch.accelerator.device_count())``, and without an accelerator
the count is 0 (``ZeroDivisionError``). On CPU the bench then applies the same configuration
through the steps ``enable_parallelism`` takes (diffusers 0.42: a ``"cpu"`` DeviceMesh,
``ParallelConfig.setup``, the processors' ``_parallel_config``, ``apply_context_parallel``
with the model's ``_cp_plan``; private API), and records why (``diffusers_cp_note``).
diffusers' Ulysses needs every split to divide evenly (tokens and heads by W), so the geometry
here does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from . import common
from ..demo.models import flux
from ..demo.ulysses import gather_sequence
from ..ulysses import UlyssesAttention, head_split
from ..ulysses.fp8 import FP8_DTYPE

__all__ = ["GEOMETRY", "dit_model_records", "markdown_rows"]

#: (latent height, width, text tokens, double blocks, single blocks, heads, head_dim, RoPE axes)
GEOMETRY = {"cpu": (16, 16, 32, 2, 2, 8, 32, (8, 12, 12)),
            "cuda": (64, 64, 512, 2, 4, 24, 128, (16, 56, 56))}
SEED = 11


def _config(geometry):
    h, w, s_t, nd, ns, heads, hd, axes = geometry
    cfg = flux.flux_config(num_layers=nd, num_single_layers=ns, num_attention_heads=heads,
                           attention_head_dim=hd, axes_dims_rope=axes)
    return cfg, (h, w, s_t)


def _enable_diffusers_cp(model, rank, world, device) -> str | None:
    """diffusers' Ulysses context parallelism on ``model`` over the default group; returns why
    ``enable_parallelism`` itself could not be used (None when it was)."""
    from diffusers import ContextParallelConfig

    try:
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        return None
    except ZeroDivisionError as exc:  # no accelerator: rank % device_count() == rank % 0
        why = (f"enable_parallelism raised ZeroDivisionError ({exc}): it places rank r on "
               f"torch.device('{torch._C._get_accelerator().type}', r % "
               f"torch.accelerator.device_count()) and this torch has "
               f"{torch.accelerator.device_count()} accelerators; applied through its steps "
               f"instead (a cpu DeviceMesh, ParallelConfig.setup, apply_context_parallel)")
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig

    cp = ContextParallelConfig(ulysses_degree=world)
    config = ParallelConfig(context_parallel_config=cp)
    mesh = init_device_mesh(device.type, cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    config.setup(rank, world, device, mesh=mesh)
    model._parallel_config = config
    for m in model.modules():
        proc = getattr(m, "processor", None)
        if proc is not None and hasattr(proc, "_parallel_config"):
            proc._parallel_config = config
    apply_context_parallel(model, cp, model._cp_plan)
    return why


def _time(fn, device, iters, cpu_g) -> float:
    times = common.time_eager(fn, warmup=2, iters=iters, device=device.type,
                              barrier=lambda: dist.barrier(group=cpu_g))
    return common.slowest_rank_median(times, cpu_g)


def _compare(out, ref) -> tuple[float, float]:
    a = out.double().reshape(-1, out.shape[-1])
    b = ref.double().reshape(-1, ref.shape[-1])
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-30)
    return float(cos.min()), float((a - b).abs().max())


def dit_model_records(rank, world, device, dtype, iters, cpu_g,
                      geometry=None) -> tuple[list[dict], str | None]:
    """``(records, diffusers_cp_note)``: one record per implementation (module docstring);
    ``geometry`` as a ``GEOMETRY`` entry (default: the device type's)."""
    cfg, (h, w, s_t) = _config(geometry or GEOMETRY[device.type])
    inputs = flux.flux_inputs(cfg, h, w, s_t, SEED + 1, device=device, dtype=dtype)
    s_img = h * w
    lens = head_split(s_img, world)
    base = dict(geometry="dit_model", world_size=world, image_tokens=s_img, text_tokens=s_t,
                double_blocks=cfg["num_layers"], single_blocks=cfg["num_single_layers"],
                heads=cfg["num_attention_heads"], head_dim=cfg["attention_head_dim"])
    model = flux.build_flux(cfg, SEED, device, dtype)

    def one_process():
        with torch.no_grad():
            return model(**inputs, return_dict=False)[0]

    ref = one_process()
    records = [dict(base, impl="one_process", time_us=_time(one_process, device, iters, cpu_g),
                    min_cos=1.0, max_abs_err=0.0)]
    for impl, payload in (("attncomm", None), ("attncomm fp8", FP8_DTYPE)):
        proc = flux.FluxUlyssesProcessor(UlyssesAttention(payload_dtype=payload,
                                                          validate=False))

        def sharded(proc=proc):
            with flux.ulysses_processors(model, proc):
                out = flux.sharded_forward(model, inputs, lens, rank)
            return gather_sequence(out, lens)

        cos, err = _compare(sharded(), ref)
        records.append(dict(base, impl=impl, time_us=_time(sharded, device, iters, cpu_g),
                            min_cos=cos, max_abs_err=err))
    cp_model = flux.build_flux(cfg, SEED, device, dtype)  # the same weights (same seed)
    note = _enable_diffusers_cp(cp_model, rank, world, device)

    def diffusers_cp():
        with torch.no_grad():
            return cp_model(**inputs, return_dict=False)[0]

    cos, err = _compare(diffusers_cp(), ref)
    records.append(dict(base, impl="diffusers_cp", time_us=_time(diffusers_cp, device, iters,
                                                                  cpu_g),
                        min_cos=cos, max_abs_err=err))
    return records, note


def markdown_rows(records: list[dict], note: str | None) -> list[str]:
    """The DiT model section of the Markdown report."""
    rows = [r for r in records if r.get("geometry") == "dit_model"]
    if not rows:
        return []
    r0 = rows[0]
    cp = next((r["time_us"] for r in rows if r["impl"] == "diffusers_cp"), None)
    lines = ["", "## A Flux transformer sharded: attncomm vs diffusers' context parallelism",
             "", f"FluxTransformer2DModel, {r0['double_blocks']} double + {r0['single_blocks']} "
             f"single blocks, {r0['heads']} heads × {r0['head_dim']}, {r0['image_tokens']} image "
             f"+ {r0['text_tokens']} text tokens, W={r0['world_size']}. One forward from the "
             "full inputs to the full output on every rank; slowest-rank median.", "",
             "| impl | time µs | diffusers_cp ÷ impl | min cos vs one process | max abs err |",
             "|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{cp / r['time_us']:.2f}×" if cp and r["time_us"] else "-"
        lines.append(f"| {r['impl']} | {r['time_us']:.0f} | {ratio} | {r['min_cos']:.8f} | "
                     f"{r['max_abs_err']:.2e} |")
    if note:
        lines += ["", f"diffusers_cp: {note}"]
    return lines
