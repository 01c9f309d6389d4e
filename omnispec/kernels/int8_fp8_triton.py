"""The Triton kernels of ``attention: int8_fp8`` (``int8_fp8.py`` says what they compute and why). A module of its own
so that its functions are module globals, which Triton resolves when one calls another, and so that importing the
operator does not import triton.

Layouts (the launcher in ``int8_fp8.py`` allocates them): the quantized q and k (int8) are [batch x heads, padded
tokens, head size] and v (e4m3) is [batch x heads, head size, padded tokens], each padded with zeros to whole blocks
of ``QUANT_BLOCK`` tokens. Hopper's 8-bit tensor-core instructions read both operands contiguous along the summed
dimension: the head size for q·kᵀ, the key tokens for p·v, hence v's transposed layout. The inputs and the output
keep the model's layout: [batch, heads, tokens, head size] seen through strides, the head size contiguous.
"""

import triton
import triton.language as tl


@triton.jit
def quantize_kernel(x, mean, channel_scales, out, block_scales, tokens, heads, x_sb, x_sh, x_st, out_sbh, out_st,
                    out_sd, blocks_per_head, BLOCK: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    # one block of BLOCK tokens of one (batch, head), quantized. MODE 0: int8 with one scale for the block,
    # max |x| / 127, rounded half away from zero (q); 1: the same after subtracting ``mean`` (k less its mean over
    # tokens); 2: e4m3 with a given scale per channel (v). Rows past ``tokens`` are written as zeros: the padded
    # buffers need no other initialisation.
    block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # offsets past 2^31 elements at long videos' batches
    b = bh // heads
    h = bh % heads
    t = block * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    live = (t < tokens)[:, None]
    values = tl.load(x + b * x_sb + h * x_sh + t[:, None] * x_st + d[None, :], mask=live, other=0.0).to(tl.float32)
    if MODE == 1:
        values = tl.where(live, values - tl.load(mean + bh * D + d)[None, :], 0.0)
    if MODE == 2:
        quantized = values / tl.load(channel_scales + bh * D + d)[None, :]
    else:
        scale = tl.maximum(tl.max(tl.max(tl.abs(values), axis=1), axis=0), 1e-30) / 127.0
        scaled = values / scale
        quantized = tl.where(scaled >= 0, scaled + 0.5, scaled - 0.5).to(tl.int32)  # the cast truncates
        tl.store(block_scales + bh * blocks_per_head + block, scale)
    tl.store(out + bh * out_sbh + t[:, None] * out_st + d[None, :] * out_sd, quantized.to(out.dtype.element_ty))


@triton.jit
def attend(q_tile, k_tile, v_tile, qk_scale, m, l, acc, cols, k_tokens, MASKED: tl.constexpr):
    # one block of keys into the running max ``m`` (base 2), row sums ``l`` and output ``acc``: ``k_tile`` is kᵀ
    # [D, keys], ``v_tile`` [keys, D], ``qk_scale`` the product of q's and k's block scales and the softmax scale
    if q_tile.dtype == tl.int8:
        # int32 sums (|s| <= 127^2 x 256 < 2^22) to float32 through the float 1.5 x 2^23's bits, an integer add and a
        # float subtraction: a conversion instruction would run on the pipe the exponentials need
        s = (tl.dot(q_tile, k_tile, out_dtype=tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    else:  # float32 storage: the arithmetic under tests
        s = tl.dot(q_tile, k_tile)
    s = s * qk_scale
    if MASKED:
        s = tl.where((cols < k_tokens)[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # p times 2^8 (exact): e4m3 then keeps probabilities down to 2^-17 instead of 2^-9
    p = tl.math.exp2(s - (m_new - 8.0)[:, None])
    alpha = tl.math.exp2(m - m_new)
    l = l * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None])
    return m_new, l, acc


@triton.jit
def finish(acc, l, v_scales, out, bh, heads, rows, q_tokens, out_sb, out_sh, out_st, D: tl.constexpr):
    # the output rows of one (batch, head): divided by the row sums (of p times 2^8 too), times v's channel scales
    d = tl.arange(0, D)
    o = acc / l[:, None] * tl.load(v_scales + bh * D + d)[None, :]
    b = bh // heads
    h = bh % heads
    tl.store(out + b * out_sb + h * out_sh + rows[:, None] * out_st + d[None, :], o.to(out.dtype.element_ty),
             mask=(rows < q_tokens)[:, None])


@triton.jit
def key_tiles(k, v, k_scales, bh, n, k_padded, BLOCK_N: tl.constexpr, D: tl.constexpr, QUANT_BLOCK: tl.constexpr,
              TMA: tl.constexpr):
    # keys n to n + BLOCK_N of (batch, head) ``bh``: kᵀ [D, BLOCK_N] (contiguous along D), v [BLOCK_N, D] (contiguous
    # along the keys), k's block scale and the keys' indices; through tensor descriptors (Hopper's TMA copies) over
    # the buffers seen as 2-d, or through pointers (the pipeliner's asynchronous copies)
    cols = n + tl.arange(0, BLOCK_N)
    if TMA:
        k_tile = k.load([(bh * k_padded + n).to(tl.int32), 0]).T
        v_tile = v.load([(bh * D).to(tl.int32), n]).T
    else:
        d = tl.arange(0, D)
        k_tile = tl.load(k + bh * k_padded * D + cols[None, :] * D + d[:, None])
        v_tile = tl.load(v + bh * D * k_padded + d[None, :] * k_padded + cols[:, None])
    return k_tile, v_tile, tl.load(k_scales + bh * (k_padded // QUANT_BLOCK) + n // QUANT_BLOCK), cols


@triton.jit
def attention_kernel(q, k, v, q_scales, k_scales, v_scales, out, q_tokens, k_tokens, heads, q_padded, k_padded,
                     qk_scale, out_sb, out_sh, out_st, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                     QUANT_BLOCK: tl.constexpr, TMA: tl.constexpr):
    # BLOCK_M query rows of one (batch, head) against all its keys, online softmax in base 2. With TMA, q, k and v
    # are tensor descriptors over the buffers seen as 2-d ([batch x heads x padded tokens, D] for q and k, [batch x
    # heads x D, padded tokens] for v); else pointers. (tl.range's warp_specialize left the descriptor loop's code
    # unchanged for sm_90 under triton 3.7.1, so it is not asked for.)
    start = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # offsets past 2^31 elements at long videos' batches
    rows = start + tl.arange(0, BLOCK_M)
    if TMA:
        q_tile = q.load([(bh * q_padded + start).to(tl.int32), 0])
    else:
        q_tile = tl.load(q + bh * q_padded * D + rows[:, None] * D + tl.arange(0, D)[None, :])
    q_scale = tl.load(q_scales + bh * (q_padded // QUANT_BLOCK) + start // QUANT_BLOCK) * qk_scale
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    whole = k_tokens // BLOCK_N * BLOCK_N
    for n in range(0, whole, BLOCK_N):
        k_tile, v_tile, k_scale, cols = key_tiles(k, v, k_scales, bh, n, k_padded, BLOCK_N, D, QUANT_BLOCK, TMA)
        m, l, acc = attend(q_tile, k_tile, v_tile, q_scale * k_scale, m, l, acc, cols, k_tokens, False)
    if whole < k_tokens:  # the last, partial block: keys past the sequence masked out
        k_tile, v_tile, k_scale, cols = key_tiles(k, v, k_scales, bh, whole, k_padded, BLOCK_N, D, QUANT_BLOCK, TMA)
        m, l, acc = attend(q_tile, k_tile, v_tile, q_scale * k_scale, m, l, acc, cols, k_tokens, True)
    finish(acc, l, v_scales, out, bh, heads, rows, q_tokens, out_sb, out_sh, out_st, D)
