"""torchtitan's Llama 3 block, written out for benchmarks/gpu_layer.py, and its parts
(the linears alone, attention alone) as that script times them on a GPU."""

from __future__ import annotations

HEAD_DIM = 128


class Block:
    """torchtitan's Llama 3 TransformerBlock (torchtitan/models/llama3/model.py), written
    here so that the GPU machine needs no torchtitan: RMSNorm in fp32, wq/wk/wv, RoPE via
    complex multiplication, repeat_kv to every query head, SDPA causal, wo, residual,
    RMSNorm, w2(silu(w1 x) * w3 x), residual. `heads`, `kv_heads`, `ffn` are one TP rank's
    share when `tp` > 1 (no collectives: one rank's compute)."""

    def __init__(self, hidden, heads, kv_heads, ffn, seq, tp=1, device="cuda"):
        import torch

        self.device = device
        self.h, self.nh, self.nkv = hidden, heads // tp, max(1, kv_heads // tp)
        self.f, self.seq = ffn // tp, seq
        d = HEAD_DIM
        kw = {"device": device, "dtype": torch.bfloat16, "requires_grad": True}
        std = 0.02
        self.wq = (torch.randn(self.nh * d, hidden, **kw) * std).detach().requires_grad_()
        self.wk = (torch.randn(self.nkv * d, hidden, **kw) * std).detach().requires_grad_()
        self.wv = (torch.randn(self.nkv * d, hidden, **kw) * std).detach().requires_grad_()
        self.wo = (torch.randn(hidden, self.nh * d, **kw) * std).detach().requires_grad_()
        self.w1 = (torch.randn(self.f, hidden, **kw) * std).detach().requires_grad_()
        self.w3 = (torch.randn(self.f, hidden, **kw) * std).detach().requires_grad_()
        self.w2 = (torch.randn(hidden, self.f, **kw) * std).detach().requires_grad_()
        self.n1 = torch.ones(hidden, **kw)
        self.n2 = torch.ones(hidden, **kw)
        freqs = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=self.device).float() / d))
        angles = torch.outer(torch.arange(seq, device=self.device).float(), freqs)
        self.freqs_cis = torch.polar(torch.ones_like(angles), angles)

    @staticmethod
    def rms(x, w, eps=1e-5):
        import torch

        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w

    def rope(self, x):
        import torch

        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        fc = self.freqs_cis.view(1, x.shape[1], 1, xc.shape[-1])
        return torch.view_as_real(xc * fc).flatten(3).type_as(x)

    def attention(self, x):
        import torch.nn.functional as F

        b, s, _ = x.shape
        q = F.linear(x, self.wq).view(b, s, self.nh, HEAD_DIM)
        k = F.linear(x, self.wk).view(b, s, self.nkv, HEAD_DIM)
        v = F.linear(x, self.wv).view(b, s, self.nkv, HEAD_DIM)
        q, k = self.rope(q), self.rope(k)
        rep = self.nh // self.nkv
        if rep > 1:   # torchtitan's repeat_kv
            k = k[:, :, :, None, :].expand(b, s, self.nkv, rep, HEAD_DIM).reshape(
                b, s, self.nh, HEAD_DIM)
            v = v[:, :, :, None, :].expand(b, s, self.nkv, rep, HEAD_DIM).reshape(
                b, s, self.nh, HEAD_DIM)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return F.linear(o.transpose(1, 2).contiguous().view(b, s, -1), self.wo)

    def ffn(self, x):
        import torch.nn.functional as F

        return F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)

    def __call__(self, x):
        h = x + self.attention(self.rms(x, self.n1))
        return h + self.ffn(self.rms(h, self.n2))

    def elementwise(self, x, leaves):
        """The block's element-wise ops alone (no linear, no attention), each on a tensor of
        the shape it meets: the two norms, RoPE of q and k, repeat_kv of k and v, the
        attention output's transpose copy, SiLU x gate, the two residual adds."""
        import torch.nn.functional as F

        q, k, v, o, a, g1, g3 = leaves
        b, s, _ = x.shape
        rep = self.nh // self.nkv
        outs = [self.rms(x, self.n1), self.rope(q), self.rope(k)]
        if rep > 1:
            outs += [t[:, :, :, None, :].expand(b, s, self.nkv, rep, HEAD_DIM).reshape(
                b, s, self.nh, HEAD_DIM) for t in (k, v)]
        outs += [o.transpose(1, 2).contiguous(), x + a, self.rms(a, self.n2),
                 F.silu(g1) * g3, a + x]
        return outs

    def leaves(self, mb):
        """Leaf tensors (requiring gradients) shaped as the block's intermediate values:
        q, k, v (b, s, heads, 128), the attention output (b, heads, s, 128), a (b, s, h),
        the two MLP branches (b, s, ffn)."""
        import torch

        s, d = self.seq, HEAD_DIM
        shapes = [(mb, s, self.nh, d), (mb, s, self.nkv, d), (mb, s, self.nkv, d),
                  (mb, self.nh, s, d), (mb, s, self.h), (mb, s, self.f), (mb, s, self.f)]
        return [torch.randn(*sh, device=self.device, dtype=torch.bfloat16, requires_grad=True)
                for sh in shapes]


def linears_only(blk: Block, x, leaves):
    """The block's seven linears, each on an input of its shape (leaves requiring
    gradients), no other op."""
    import torch.nn.functional as F

    _, _, _, o, _, g1, _ = leaves
    b, s, _ = x.shape
    return [F.linear(x, w) for w in (blk.wq, blk.wk, blk.wv, blk.w1, blk.w3)] + [
        F.linear(o.transpose(1, 2).reshape(b, s, -1), blk.wo), F.linear(g1, blk.w2)]


def attention_only(blk: Block, mb: int, seq: int, backend: str = "default"):
    """SDPA on q, k, v of the block's local heads (k, v already repeated), with torch's
    default choice of kernel or cuDNN's."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not hasattr(blk, "_qkv"):
        blk._qkv = [torch.randn(mb, blk.nh, seq, HEAD_DIM, device=blk.device, dtype=torch.bfloat16,
                                requires_grad=True) for _ in range(3)]
    q, k, v = blk._qkv
    use = (sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if backend == "cudnn"
           else contextlib.nullcontext())
    with use:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
