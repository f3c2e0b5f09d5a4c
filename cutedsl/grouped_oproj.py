"""The DSv4 grouped o-projection wo_a, with the inverse RoPE before it.

o bf16 [T, NH, hd] (attention output; its last 64 dims of each head carry the key rotation) →
BF16 inverse RoPE at the query positions (float32 cos‖sin cache [max_pos, 64]) → view [T, G, D]
with D = NH·hd/G (group g = heads g·NH/G … (g+1)·NH/G − 1) → out[t, g] = x[t, g] · W_gᵀ, W_g =
rows g·R … (g+1)·R − 1 of the checkpoint's wo_a weight u8 [G·R, D//2] → bf16 [T, G, R]; the caller
flattens it for wo_b. Backends and graph notes as in `cutedsl.linear`. On the GPU backends the
inverse RoPE writes into the device's "main" `cutedsl.workspace` (reserved by `warmup`, sized for
`head_dim`), so a call allocates only its result: on CUDA with the sm90 / sm100 backend as one
CuTeDSL kernel (`cutedsl.kernels.rope`, compiled by `warmup`), otherwise (sm100-emulated, or
tensors off CUDA) as that kernel's torch statement `inverse_rope_into`.
"""

from __future__ import annotations

import torch

from cutedsl import formats, jit, ops, reference
from cutedsl.runner import Runner
from cutedsl.sm90 import runners as sm90_runners
from cutedsl.sm90.tactics import GpuSpec
from cutedsl.sm100 import runners as sm100_runners
from cutedsl.validate import check_tensor, scalar_f32
from cutedsl.workspace import Workspace, for_role

_HALF = reference.ROPE_DIM // 2


def inverse_rope_into(
    out: torch.Tensor,  # [T, NH, hd] bf16, written
    o: torch.Tensor,  # [T, NH, hd] bf16
    positions: torch.Tensor,  # int [T]
    cos_sin_cache: torch.Tensor,  # fp32 [max_pos, 64]
    ws: Workspace,
) -> torch.Tensor:
    """`reference.inverse_rope_ref(o, positions, cos_sin_cache)` into `out`, with its fp32
    temporaries in `ws` ("rope.cs" [T, 64], "rope.e" / "rope.o" / "rope.y" [T, NH, 32]): the same
    fp32 operations, no allocation."""
    t, nh, _ = o.shape
    out.copy_(o)
    rope = out[..., -reference.ROPE_DIM :]
    even, odd = rope[..., 0::2], rope[..., 1::2]
    cs = ws.get("rope.cs", (t, reference.ROPE_DIM), torch.float32)
    torch.index_select(cos_sin_cache, 0, positions, out=cs)
    cos, sin = cs[:, None, :_HALF], cs[:, None, _HALF:]
    e = ws.get("rope.e", (t, nh, _HALF), torch.float32)
    od = ws.get("rope.o", (t, nh, _HALF), torch.float32)
    y = ws.get("rope.y", (t, nh, _HALF), torch.float32)
    e.copy_(even)
    od.copy_(odd)
    torch.mul(e, cos, out=y)
    y.addcmul_(od, sin)  # x[2j]·cos + x[2j+1]·sin
    even.copy_(y)
    torch.mul(od, cos, out=y)
    y.addcmul_(e, sin, value=-1.0)  # x[2j+1]·cos − x[2j]·sin
    odd.copy_(y)
    return out


def _rope_build(head_dim: int, no_jit_engine: bool = False) -> object:
    from cutedsl.kernels.rope import compile_inverse_rope

    return compile_inverse_rope(head_dim, no_jit_engine=no_jit_engine)


def rope_job(head_dim: int) -> jit.Job:
    """The `jit.Job` of the inverse-RoPE kernel for one head_dim."""
    return jit.Job(_rope_build, (head_dim,))


def sm90_jobs(
    n: int, k: int, groups: int, head_dim: int, max_tokens: int, spec: GpuSpec
) -> list[jit.Job]:
    """What `Nvfp4GroupedOproj.warmup` compiles on the sm90 backend (G groups of N rows x K,
    up to max_tokens rows): its GEMM tactics and the inverse-RoPE kernel."""
    return sm90_runners.linear_jobs(n, k, groups, max_tokens, spec) + [rope_job(head_dim)]


def inverse_rope(
    out: torch.Tensor, o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> torch.Tensor:
    """`inverse_rope_into`'s result as one CuTeDSL kernel (`cutedsl.kernels.rope`): o bf16
    [T, NH, hd] with unit stride along hd and token / head strides that are multiples of 8 (a
    head slice of a padded buffer is fine), out bf16 [T, NH, hd] contiguous, both 16-byte
    aligned; positions int64 [T] (int32 is widened first); cos_sin_cache fp32 [max_pos, 64]
    contiguous; all on one CUDA device."""
    t, nh, hd = o.shape
    if o.dtype != torch.bfloat16 or o.stride(2) != 1 or o.stride(0) % 8 or o.stride(1) % 8:
        raise ValueError(
            f"inverse_rope: o {o.dtype} with strides {o.stride()}: expected bfloat16, unit stride "
            "along head_dim, token and head strides multiples of 8"
        )
    for name, x in (("o", o), ("out", out)):
        if x.data_ptr() % 16:
            raise ValueError(f"inverse_rope: {name} must be 16-byte aligned")
    if out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError("inverse_rope: out must be contiguous bfloat16")
    if out.shape != o.shape or positions.shape != (t,) or nh > 65535:
        raise ValueError(
            f"inverse_rope: o {list(o.shape)}, out {list(out.shape)}, positions "
            f"{list(positions.shape)}: expected equal shapes, [T] positions and NH <= 65535"
        )
    if not cos_sin_cache.is_contiguous() or cos_sin_cache.dtype != torch.float32:
        raise ValueError("inverse_rope: cos_sin_cache must be contiguous float32")
    if t:
        jit.compiled(_rope_build, hd)(o, positions.long(), cos_sin_cache, out)
    return out


class Nvfp4GroupedOproj(Runner):
    impls = {
        "sm90": sm90_runners.GroupedOproj,
        "sm100": sm100_runners.GroupedOproj,
        "sm100-emulated": sm100_runners.EmulatedGroupedOproj,
    }
    checkpoint_tensors = ("weight", "weight_scale")

    def __init__(
        self,
        weight: torch.Tensor,  # (G*R, D//2) uint8 e2m1x2
        weight_scale: torch.Tensor,  # (G*R, D//16) float8_e4m3fn, linear
        weight_scale_2: torch.Tensor | float,  # () fp32
        input_scale: torch.Tensor | float | None = None,  # () fp32
        *,
        n_groups: int,
        head_dim: int = 512,  # of the attention output o; sizes the GPU backends' RoPE workspace
        out_dtype: torch.dtype = torch.bfloat16,
        backend: str | None = None,
    ) -> None:
        check_tensor("weight", weight, (None, None), (torch.uint8,))
        if n_groups <= 0 or weight.shape[0] % n_groups:
            raise ValueError(
                f"weight: {weight.shape[0]} rows, expected a multiple of n_groups={n_groups}"
            )
        self.n_groups, self.r, self.d = n_groups, weight.shape[0] // n_groups, weight.shape[1] * 2
        if self.d % formats.BLOCK:
            raise ValueError(f"weight: D = {self.d}, expected a multiple of 16")
        dev = weight.device
        check_tensor(
            "weight_scale",
            weight_scale,
            (weight.shape[0], self.d // 16),
            (torch.float8_e4m3fn,),
            dev,
        )
        self.weight, self.weight_scale = weight, weight_scale
        self.weight_scale_2 = scalar_f32("weight_scale_2", weight_scale_2, dev)
        self.input_scale = scalar_f32("input_scale", input_scale, dev)
        self.out_dtype = out_dtype
        self.head_dim = head_dim
        self._setup(dev, backend)

    def _rope_kernel(self) -> bool:
        """The inverse RoPE runs as the CuTeDSL kernel (else as its torch statement)."""
        return self.backend in ("sm90", "sm100") and self.device.type == "cuda"

    def warmup(self, max_tokens: int) -> None:
        super().warmup(max_tokens)
        if self.backend != "reference":
            ws, nh = for_role(self.device, "main"), self.n_groups * self.d // self.head_dim
            ws.reserve("rope.x", (max_tokens, nh, self.head_dim), torch.bfloat16)
            if self._rope_kernel():
                jit.compiled(_rope_build, self.head_dim)
                return
            ws.reserve("rope.cs", (max_tokens, reference.ROPE_DIM), torch.float32)
            for name in ("rope.e", "rope.o", "rope.y"):
                ws.reserve(name, (max_tokens, nh, _HALF), torch.float32)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        y = reference.nvfp4_grouped_oproj_ref(
            x, self.weight, self.weight_scale, self.weight_scale_2
        )
        return y.to(self.out_dtype)

    def run(
        self, o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> torch.Tensor:
        check_tensor("o", o, (None, None, None), (torch.bfloat16,), self.device)
        t, nh, hd = o.shape
        if nh * hd != self.n_groups * self.d:
            raise ValueError(
                f"o: shape {list(o.shape)}, expected NH·head_dim = G·D = {self.n_groups}·{self.d}"
            )
        check_tensor("positions", positions, (t,), (torch.int32, torch.int64), self.device)
        check_tensor(
            "cos_sin_cache",
            cos_sin_cache,
            (None, reference.ROPE_DIM),
            (torch.float32,),
            self.device,
        )
        if t == 0:
            return o.new_empty((0, self.n_groups, self.r), dtype=self.out_dtype)
        if self.backend == "reference":
            x = reference.inverse_rope_ref(o, positions, cos_sin_cache)
        elif self._rope_kernel():
            x = inverse_rope(
                for_role(self.device, "main").get("rope.x", o.shape, o.dtype),
                o, positions, cos_sin_cache.contiguous(),
            )  # fmt: skip
        else:
            ws = for_role(self.device, "main")
            x = inverse_rope_into(
                ws.get("rope.x", o.shape, o.dtype), o, positions, cos_sin_cache, ws
            )
        return self._impl(x.view(t, self.n_groups, self.d))

    def __call__(
        self, o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> torch.Tensor:
        return ops.nvfp4_grouped_oproj(o, positions, cos_sin_cache, self.id)
