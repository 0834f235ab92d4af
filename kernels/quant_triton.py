"""Triton GEMMs for quantized checkpoints' weights on GPUs (tested under triton's interpreter
on the CPU against kernels/quant_ref.py and the int8 reference of actors/quantization/linear.py):

- int_group_gemm: y = x @ W^T + b for integer weights packed in int32 as the checkpoint has
  them, unpacked in the kernel: GPTQ (qweight [K*bits/32, N] packed along K, qzeros stored
  minus one), AWQ (qweight [K, N/8] in AWQ's column order) and compressed-tensors
  pack-quantized (weight_packed [N, K*bits/32], symmetric). Each weight is s[g, n] * (q - z)
  with g = g_idx[k], so act-order (desc_act) checkpoints run unpermuted. fp16/bf16 (or fp32)
  activations, fp32 accumulation.
- fp8_weight_gemm: FP8 E4M3 weights decoded from their bits in the kernel, times a per
  output channel scale (the fallback where torch._scaled_mm cannot run: GPUs before Ada).
- int8_scaled_gemm: W8A8, int8 x int8 accumulated in int32, scaled by per-token and
  per-channel scales in the epilogue."""

from __future__ import annotations

import torch

from kernels._triton import cdiv, dot_precision, jit, tl

GPTQ, AWQ, PACKED = 0, 1, 2  # the integer layouts (CheckpointQuant.layout "gptq", "awq", "pack")
_LAYOUTS = {"gptq": GPTQ, "awq": AWQ, "pack": PACKED}
_BLOCK_M, _BLOCK_N, _BLOCK_K = 16, 32, 32


@jit
def _int_group_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, qzeros_ptr, g_idx_ptr, bias_ptr, out_ptr,
    M, N, K, num_groups, x_stride, out_stride,
    LAYOUT: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < M, n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        kn_mask = k_mask[:, None] & n_mask[None, :]
        g = tl.load(g_idx_ptr + k, mask=k_mask, other=0)
        if LAYOUT == 0:  # GPTQ: words [K / PER_WORD, N]; zeros [groups, N / PER_WORD], stored minus one
            words = tl.load(qweight_ptr + (k // PER_WORD)[:, None] * N + n[None, :], mask=kn_mask, other=0)
            q = (words >> ((k % PER_WORD) * BITS)[:, None]) & MASK
            zero_words = tl.load(qzeros_ptr + g[:, None] * (N // PER_WORD) + (n // PER_WORD)[None, :],
                                 mask=kn_mask, other=0)
            z = ((zero_words >> ((n % PER_WORD) * BITS)[None, :]) & MASK) + 1
            s = tl.load(scales_ptr + g[:, None] * N + n[None, :], mask=kn_mask, other=0.0)
        elif LAYOUT == 1:  # AWQ: words [K, N / 8], column c of a word in nibble (c // 2) + 4 * (c % 2)
            c = n % 8
            shift = ((c // 2) + 4 * (c % 2)) * 4
            words = tl.load(qweight_ptr + k[:, None] * (N // 8) + (n // 8)[None, :], mask=kn_mask, other=0)
            q = (words >> shift[None, :]) & 15
            zero_words = tl.load(qzeros_ptr + g[:, None] * (N // 8) + (n // 8)[None, :], mask=kn_mask, other=0)
            z = (zero_words >> shift[None, :]) & 15
            s = tl.load(scales_ptr + g[:, None] * N + n[None, :], mask=kn_mask, other=0.0)
        else:  # compressed-tensors pack-quantized: words [N, K / PER_WORD], symmetric; scales [N, groups]
            words = tl.load(qweight_ptr + n[None, :] * (K // PER_WORD) + (k // PER_WORD)[:, None], mask=kn_mask,
                            other=0)
            q = (words >> ((k % PER_WORD) * BITS)[:, None]) & MASK
            z = 1 << (BITS - 1)
            s = tl.load(scales_ptr + n[None, :] * num_groups + g[:, None], mask=kn_mask, other=0.0)
        w = (q - z).to(tl.float32) * s.to(tl.float32)  # [BLOCK_K, BLOCK_N]
        xs = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            acc += tl.dot(xs.to(tl.float32), w, input_precision=INPUT_PRECISION)
        else:
            acc += tl.dot(xs, w.to(xs.dtype), input_precision=INPUT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * out_stride + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def int_group_gemm(x: torch.Tensor, layout: str, bits: int, qweight: torch.Tensor, scales: torch.Tensor,
                   qzeros: torch.Tensor | None, g_idx: torch.Tensor, out_features: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ the packed weight's [N, K]^T (+ bias) -> [M, N] in x's dtype. g_idx [K] int32:
    each input channel's group (arange(K) // group_size where the checkpoint has none);
    qzeros: None for pack-quantized (symmetric)."""
    assert x.dim() == 2 and x.stride(1) == 1 and out_features % 8 == 0
    M, K = x.shape
    code = _LAYOUTS[layout]
    num_groups = scales.shape[1] if code == PACKED else scales.shape[0]
    out = torch.empty(M, out_features, dtype=x.dtype, device=x.device)
    grid = (cdiv(M, _BLOCK_M), cdiv(out_features, _BLOCK_N))
    _int_group_gemm_kernel[grid](
        x, qweight, scales, qzeros if qzeros is not None else scales, g_idx, bias if bias is not None else x, out,
        M, out_features, K, num_groups, x.stride(0), out.stride(0),
        LAYOUT=code, BITS=bits, HAS_BIAS=bias is not None, UPCAST=x.device.type == "cpu",
        INPUT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K)
    return out


@jit
def _fp8_weight_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, x_stride, out_stride,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < M, n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        bits = tl.load(w_ptr + n[None, :] * K + k[:, None], mask=k_mask[:, None] & n_mask[None, :],
                       other=0).to(tl.int32)  # [BLOCK_K, BLOCK_N] E4M3 bytes
        exponent = (bits >> 3) & 15
        mantissa = bits & 7
        # a normal E4M3 number as float32 bits (exponent bias 7 -> 127), a subnormal as m * 2^-9
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
        w = tl.where((bits & 128) != 0, -magnitude, magnitude)
        xs = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            acc += tl.dot(xs.to(tl.float32), w, input_precision=INPUT_PRECISION)
        else:
            acc += tl.dot(xs, w.to(xs.dtype), input_precision=INPUT_PRECISION)
    acc *= tl.load(scale_ptr + n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * out_stride + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def fp8_weight_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] E4M3 * scale [N] float32)^T (+ bias), activations as they are."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous() and scale.shape == (weight.shape[0],)
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (cdiv(M, _BLOCK_M), cdiv(N, _BLOCK_N))
    _fp8_weight_gemm_kernel[grid](
        x, weight.view(torch.uint8), scale.float().contiguous(), bias if bias is not None else x, out,
        M, N, K, x.stride(0), out.stride(0), HAS_BIAS=bias is not None, UPCAST=x.device.type == "cpu",
        INPUT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 weights [N, K] with per-channel scales [N]: torch._scaled_mm on GPUs with FP8
    (compute capability 8.9+), activations quantized per token to E4M3 (dynamic); else the
    Triton weight-only kernel above."""
    if x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9) and x.dtype == torch.bfloat16:
        x_fp8, x_scale = quantize_fp8_rows(x)
        out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=scale.float().view(1, -1),
                               bias=bias, out_dtype=x.dtype)
        return out
    return fp8_weight_gemm(x, weight, scale, bias)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row scaled into E4M3's range (448) by its absolute maximum: (fp8 [M, K], scale [M, 1])."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


@jit
def _int8_scaled_gemm_kernel(
    xq_ptr, wq_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K, x_stride, out_stride,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < M, n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xs = tl.load(xq_ptr + m[:, None] * x_stride + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0)
        ws = tl.load(wq_ptr + n[None, :] * K + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        if UPCAST:  # the interpreter: products summed exactly in float32 (|sum| < 2^24 at these sizes)
            acc += tl.dot(xs.to(tl.float32), ws.to(tl.float32)).to(tl.int32)
        else:
            acc += tl.dot(xs, ws, out_dtype=tl.int32)
    out = acc.to(tl.float32) * tl.load(x_scale_ptr + m, mask=m_mask, other=0.0)[:, None]
    out *= tl.load(w_scale_ptr + n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * out_stride + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def int8_scaled_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(xq [M, K] int8 * x_scale [M]) @ (wq [N, K] int8 * w_scale [N])^T (+ bias) -> [M, N]."""
    assert xq.dtype == wq.dtype == torch.int8 and xq.stride(1) == 1 and wq.is_contiguous()
    M, K = xq.shape
    N = wq.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    grid = (cdiv(M, _BLOCK_M), cdiv(N, _BLOCK_N))
    _int8_scaled_gemm_kernel[grid](
        xq, wq, x_scale.float().reshape(-1).contiguous(), w_scale.float().reshape(-1).contiguous(),
        bias if bias is not None else w_scale, out, M, N, K, xq.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, UPCAST=xq.device.type == "cpu",
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K)
    return out
