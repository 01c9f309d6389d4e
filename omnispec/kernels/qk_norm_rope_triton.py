"""The Triton kernel of ``omnispec::qk_norm_rope`` (``qk_norm_rope.py`` says what it computes and why). A module
of its own so that its functions are module globals, which Triton resolves when one calls another, and so that
importing the operator does not import triton."""

import triton
import triton.language as tl


@triton.jit
def norm_rope_heads(first, second, out, weight_first, weight_second, first_sb, first_st, first_sh, second_sb,
                    second_st, second_sh, b, t, h0, live, in_first, first_tokens, eps, out_sb, out_st, out_sh,
                    cos_even, cos_odd, sin_even, sin_odd, TOKENS: tl.constexpr, HEADS: tl.constexpr,
                    D: tl.constexpr):
    # one tensor's HEADS heads of the program's tokens (the text stream's first: ``first``, then ``second``'s)
    col = tl.arange(0, D)
    w = tl.where(in_first, tl.load(weight_first + col)[None, :], tl.load(weight_second + col)[None, :])
    w = w.to(tl.float32)
    # each stream's rows with its own head stride, then one pointer chosen per token: a head stride chosen per token
    # hides the rows' contiguity from triton 3.9, which then loads 2 bytes an instruction (test_qk_norm_rope checks)
    first_rows = first + (b * first_sb + t * first_st)[:, None] + col[None, :]
    second_rows = second + (b * second_sb + (t - first_tokens) * second_st)[:, None] + col[None, :]
    target = out + (b * out_sb + t * out_st)[:, None] + col[None, :]
    for i in tl.static_range(HEADS):
        h = h0 + i
        x = tl.load(tl.where(in_first, first_rows + h * first_sh, second_rows + h * second_sh), mask=live, other=0.0)
        x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        normed = (x * rstd[:, None] * w).to(out.dtype.element_ty).to(tl.float32)  # the norm's output
        even, odd = tl.split(tl.reshape(normed, (TOKENS, D // 2, 2)))
        rotated = tl.join(even * cos_even - odd * sin_even, odd * cos_odd + even * sin_odd)
        tl.store(target + h * out_sh, tl.reshape(rotated, (TOKENS, D)).to(out.dtype.element_ty), mask=live)


@triton.jit
def qk_norm_rope_kernel(q_first, q_second, q_out, q_weight_first, q_weight_second, q_first_sb, q_first_st,
                        q_first_sh, q_second_sb, q_second_st, q_second_sh,
                        k_first, k_second, k_out, k_weight_first, k_weight_second, k_first_sb, k_first_st,
                        k_first_sh, k_second_sb, k_second_st, k_second_sh,
                        cos, sin, tokens, first_tokens, eps, out_sb, out_st, out_sh,
                        TOKENS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, PAIRED: tl.constexpr):
    # TOKENS tokens of HEADS heads a program, of q and (PAIRED) of k: each token's angles are read once for all
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    h0 = tl.program_id(1) * HEADS
    b = tl.program_id(2)
    live = (t < tokens)[:, None]
    in_first = (t < first_tokens)[:, None]
    angles = t[:, None] * D + tl.arange(0, D)[None, :]
    cos_even, cos_odd = tl.split(tl.reshape(tl.load(cos + angles, mask=live, other=0.0), (TOKENS, D // 2, 2)))
    sin_even, sin_odd = tl.split(tl.reshape(tl.load(sin + angles, mask=live, other=0.0), (TOKENS, D // 2, 2)))
    norm_rope_heads(q_first, q_second, q_out, q_weight_first, q_weight_second, q_first_sb, q_first_st,
                    q_first_sh, q_second_sb, q_second_st, q_second_sh, b, t, h0, live, in_first, first_tokens,
                    eps, out_sb, out_st, out_sh, cos_even, cos_odd, sin_even, sin_odd, TOKENS, HEADS, D)
    if PAIRED:
        norm_rope_heads(k_first, k_second, k_out, k_weight_first, k_weight_second, k_first_sb, k_first_st,
                        k_first_sh, k_second_sb, k_second_st, k_second_sh, b, t, h0, live, in_first,
                        first_tokens, eps, out_sb, out_st, out_sh, cos_even, cos_odd, sin_even, sin_odd, TOKENS,
                        HEADS, D)
