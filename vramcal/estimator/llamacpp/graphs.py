"""The worst-case graphs of the architectures beyond the llama family, node by node as llama.cpp builds them
(the tree llama-cpp-python 0.3.36 vendors), for :mod:`.compute`'s allocator replay.

Each is written lazily (:class:`.ggml_graph.Graph` ``lazy=True``): tensors with their ggml shapes, and
``expand`` where llama.cpp calls ``ggml_build_forward_expand``, so the node order is ggml's own. Weights, the
KV cache and the recurrent states live in buffers of their own and are left out of the sources; an op that
writes into a cache (``set_rows``, ``cpy`` into a state view) returns a view of it and takes nothing here.

Written down (docs/llamacpp.md has the table, each with its source file): deepseek2 with MLA (the absorbed
``attn_k_b`` / ``attn_v_b`` attention over one latent K row, flash attention or not), mamba and mamba2
(``build_rs``, ``ssm_conv``, ``ssm_scan``), granitehybrid, nemotron_h, falcon-h1 and jamba (those mixers beside
KV attention), lfm2 (the short convolution), qwen3next (the fused gated delta net and gated attention), rwkv6
and rwkv7 (token shift, time mix, channel mix). Each builder takes the ubatch llama-context.cpp
``graph_reserve`` builds (:func:`build`) and the layers on one device.
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING

from .ggml_graph import F16, F32, I32, I64, Graph, Node
from .gguf_file import GgufModel

if TYPE_CHECKING:  # annotations only: compute.py hands these in
    from .buffers import Context, Hparams


def _int(m: GgufModel, key: str, default: int = 0) -> int:
    v = m.get(key, default)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _has(m: GgufModel, suffix: str) -> bool:
    return any(t.name.endswith(suffix) for t in m.tensors)


def replays(m: GgufModel, h: Hparams) -> bool:
    """Whether this module writes the GGUF's graph down."""
    mem = h.memory
    if h.arch == "deepseek2":
        return mem is not None and mem.mla
    return h.arch in BUILDERS


def caveats(m: GgufModel, h: Hparams) -> list[str]:
    """What a replayed graph leaves out for this GGUF, for the estimate's notes."""
    out = []
    if h.n_expert and _int(m, ".expert_group_count") > 1:
        out.append(f"{h.arch}: the MoE's expert-group selection (expert_group_count "
                   f"{_int(m, '.expert_group_count')}) is not written down: a few [n_expert, n_ubatch] tensors "
                   "more in llama.cpp's graph")
    return out


def _norm(g: Graph, x: Node, ne: tuple[int, ...] | None = None) -> Node:
    """``build_norm`` RMS with a weight: rms_norm, then mul (both in place where ggml may); ``ne`` the shape
    of a strided ``x``."""
    ne = ne or x.layout[1:]
    return g.t("mul", ne, g.t("rms_norm", ne, x))


def _ffn(g: Graph, x: Node, n_ff: int, T: int) -> Node:
    """``build_ffn`` SiLU, parallel gate: gate and up, swiglu, down."""
    E = x.layout[1]
    gate = g.t("mul_mat", (n_ff, T), x)
    up = g.t("mul_mat", (n_ff, T), x)
    return g.t("mul_mat", (E, T), g.t("glu", (n_ff, T), gate, up))


def _moe(g: Graph, x: Node, n_expert: int, k: int, n_ff: int, T: int, norm_w: bool, scale: float,
         probs_bias: bool = False) -> Node:
    """``build_moe_ffn`` with split gate/up experts: softmax or sigmoid gating (both one op in place), the
    selection biased where the model has ``exp_probs_b``; expert groups are not written down."""
    E = x.layout[1]
    probs = g.t("soft_max", (n_expert, T), g.t("mul_mat", (n_expert, T), x))
    selection = g.t("add", (n_expert, T), probs) if probs_bias else probs
    top_k = g.strided(g.t("argsort", (n_expert, T), selection, size=I32))  # ggml_argsort_top_k: a view of the sort
    w = g.t("get_rows", (1, k, T), g.reshape(probs, (1, n_expert, T)), top_k)
    if norm_w:
        w2 = g.reshape(w, (k, T))
        total = g.t("clamp", (1, T), g.t("sum_rows", (1, T), w2))
        w = g.reshape(g.t("div", (k, T), w2, total), (1, k, T))
    if scale not in (0.0, 1.0):
        w = g.t("scale", (1, k, T), w)
    g.expand(w)
    x3 = g.reshape(x, (E, 1, T))
    gate = g.t("mul_mat_id", (n_ff, k, T), x3, top_k)
    up = g.t("mul_mat_id", (n_ff, k, T), x3, top_k)
    down = g.t("mul_mat_id", (E, k, T), g.t("glu", (n_ff, k, T), gate, up), top_k)
    weighted = g.t("mul", (E, k, T), down, w)
    views = [g.strided(weighted) for _ in range(k)]
    out = views[0]
    for v in views[1:]:
        out = g.t("add", (E, T), out, v)
        g.expand(out)
    if k == 1:
        out = g.t("cont", (E, T), out)
    return out


def _inputs(g: Graph, E: int, T: int) -> Node:
    """``build_inp_embd``: the token ids' rows of ``token_embd``, and the embeddings input beside them
    (``ggml_build_forward_select`` puts both in the graph)."""
    emb = g.t("get_rows", (E, T), g.new_input((T,), I32))
    g.expand(emb, g.new_input((E, T)))
    return emb


def _finish(g: Graph, x: Node, n_vocab: int, T: int, with_output: bool, logit_scale: bool = False,
            rows: Node | None = None) -> None:
    """The output layer (the final RMS norm and the logits, scaled where the model says; ``rows``: the output ids
    whose rows are taken after the norm, where the model does that rather than in its last layer), or, on a
    device without it, the last layer's result."""
    if not with_output:
        g.expand(x)
        return
    x = _norm(g, x)
    if rows is not None:
        T = rows.layout[1]
        x = g.t("get_rows", (x.layout[1], T), x, rows)
    logits = g.t("mul_mat", (n_vocab, T), x)
    if logit_scale:
        logits = g.t("scale", (n_vocab, T), logits)
    logits.is_output = True
    g.expand(logits)


def deepseek2_mla(m: GgufModel, h: Hparams, c: Context, n_tokens: int, n_outputs: int, layers: range,
                  with_output: bool) -> Graph:
    """src/models/deepseek2.cpp, MLA with the absorption (``attn_k_b`` / ``attn_v_b``), q through ``q_lora`` (or
    one ``wq``: the lite models)."""
    g = Graph(lazy=True)
    T, E, fa = n_tokens, h.n_embd, c.flash_attn
    H = h.n_head[0]
    hk = _int(m, ".attention.key_length_mla")  # nope + rope per head
    v_head = _int(m, ".attention.value_length_mla")
    rope = _int(m, ".rope.dimension_count")
    q_lora, kv_lora = _int(m, ".attention.q_lora_rank"), _int(m, ".attention.kv_lora_rank")
    n_dense = _int(m, ".leading_dense_block_count")
    n_ff_exp = h.n_ff_exp
    n_shared = _int(m, ".expert_shared_count")
    norm_w = bool(m.get(".expert_weights_norm", False))
    probs_bias = _has(m, "exp_probs_b.bias")
    w_scale = float(m.get(".expert_weights_scale", 0.0) or 0.0)
    n_kv, ns = c.n_ctx_seq, c.n_stream
    per_stream = T // ns  # build() rounds T to a multiple of np
    last = h.n_layer - (h.memory.n_layer_nextn if h.memory else 0) - 1

    cur = _inputs(g, E, T)
    pos = g.new_input((T,), I32)
    k_idx = g.new_input((T,), I64)
    mask = g.new_input((n_kv, per_stream, 1, ns), F16 if fa else F32)
    out_ids = g.new_input((n_outputs,), I32)
    for il in (il for il in layers if il <= last):  # the MTP layers are a graph of their own (graph_mtp)
        inp_sa = cur
        x = _norm(g, cur)
        q = g.t("mul_mat", (H * hk, T), _norm(g, g.t("mul_mat", (q_lora, T), x)) if q_lora else x)  # lite: wq
        q = g.reshape(q, (hk, H, T))
        kv_pe = g.t("mul_mat", (kv_lora + rope, T), x)
        k_pe = g.t("rope", (rope, 1, T), g.strided(kv_pe), pos)
        kv_cmpr = g.t("mul", (kv_lora, T), g.t("rms_norm", (kv_lora, T), g.strided(kv_pe)))
        q_pe = g.t("rope", (rope, H, T), g.strided(q), pos)
        q_abs = g.t("mul_mat", (kv_lora, T, H), g.strided(g.strided(q)))  # attn_k_b x q_nope, permuted
        q_cur = g.t("concat", (kv_lora + rope, H, T), g.strided(q_abs), q_pe)
        v_cur = g.reshape(kv_cmpr, (kv_lora, 1, T))
        k_cur = g.t("concat", (kv_lora + rope, 1, T), v_cur, k_pe)
        g.expand(q_cur, v_cur, k_cur, g.write("set_rows", g.reshape(k_cur, (kv_lora + rope, T)), k_idx))
        qp = g.strided(g.strided(q_cur))  # the per-stream view, permuted
        if fa:
            att = g.t("flash_attn_ext", (kv_lora, H, T), qp, mask)
            att = g.t("mul_mat", (v_head, T, H), g.strided(att))  # attn_v_b
            att = g.t("cont", (v_head, H, T), g.strided(att))
            att = g.reshape(att, (v_head * H, T))
        else:
            v = g.t("cont", (n_kv, kv_lora, 1, ns), size=F16)  # the latent V transposed out of the cache
            kq = g.t("soft_max", (n_kv, per_stream, H, ns), g.t("mul_mat", (n_kv, per_stream, H, ns), qp), mask)
            kqv = g.t("mul_mat", (kv_lora, per_stream, H, ns), v, kq)
            kqv = g.t("mul_mat", (v_head, per_stream, H, ns), kqv)  # attn_v_b
            att = g.t("cont", (v_head * H, T), g.strided(kqv))
        g.expand(att)
        cur = g.t("mul_mat", (E, T), att)  # attn_output
        if il == last:
            cur = g.t("get_rows", (E, n_outputs), cur, out_ids)
            inp_sa = g.t("get_rows", (E, n_outputs), inp_sa, out_ids)
            T = n_outputs
        ffn_inp = g.t("add", (E, T), cur, inp_sa)
        x = _norm(g, ffn_inp)
        if il < n_dense:
            y = _ffn(g, x, h.n_ff[il], T)
        else:
            moe = _moe(g, x, h.n_expert, h.n_expert_used, n_ff_exp, T, norm_w, w_scale, probs_bias)
            y = g.t("add", (E, T), moe, _ffn(g, x, n_ff_exp * n_shared, T))
        cur = g.t("add", (E, T), y, ffn_inp)
        g.expand(cur)
    _finish(g, cur, h.n_vocab, T, with_output)
    return g


# ------------------------------------------------------------------------------------- recurrent state


def _rs(g: Graph, s_copy: tuple[Node, Node], state_size: int, n_seqs: int, rows: Node | None = None) -> Node:
    """llama-graph.cpp ``build_rs``: the cleared state zeroed in place (in the RS buffer), this ubatch's states
    gathered (``get_rows``, or ``rows``: the op that reads them, ``ssm_scan``), the other cells' copied back in
    place. Reserved with every cell in use, the extra copy has no rows."""
    g.expand(g.write("scale"))  # ggml_scale_inplace on a view of the state: nothing allocated
    out = rows if rows is not None else g.t("get_rows", (state_size, n_seqs), s_copy[0])
    g.expand(out)
    g.expand(g.write("cpy", g.t("get_rows", (state_size, 0), s_copy[1])))
    return out


def _mamba_layer(m: GgufModel, g: Graph, x: Node, s_copy: tuple[Node, Node], n_embd_r: int, T: int, S: int) -> Node:
    """src/models/mamba-base.cpp ``build_mamba_layer`` (Mamba-1: a d_state x d_inner decay, K = 1)."""
    d_conv, d_inner = _int(m, ".ssm.conv_kernel"), _int(m, ".ssm.inner_size")
    d_state, dt_rank = _int(m, ".ssm.state_size"), _int(m, ".ssm.time_step_rank")
    ts = T // S
    conv = g.reshape(_rs(g, s_copy, n_embd_r, S), (d_conv - 1, d_inner, S))
    xz = g.t("mul_mat", (2 * d_inner, ts, S), g.reshape(x, (x.layout[1], ts, S)))
    conv_x = g.t("concat", (d_conv - 1 + ts, d_inner, S), conv, g.strided(g.strided(xz)))
    g.expand(g.write("cpy", g.strided(conv_x)))
    xc = g.t("unary", (d_inner, ts, S), g.t("add", (d_inner, ts, S), g.t("ssm_conv", (d_inner, ts, S), conv_x)))
    x_db = g.t("mul_mat", (dt_rank + 2 * d_state, ts, S), xc)
    dt, b, c = g.strided(x_db), g.strided(x_db), g.strided(x_db)
    if m.get(".ssm.dt_b_c_rms") or _has(m, "ssm_dt_norm.weight"):
        dt = g.t("mul", (dt_rank, ts, S), g.t("rms_norm", (dt_rank, ts, S), dt))
        b = g.t("mul", (d_state, 1, ts, S), g.t("rms_norm", (d_state, 1, ts, S), b))
        c = g.t("mul", (d_state, 1, ts, S), g.t("rms_norm", (d_state, 1, ts, S), c))
    else:
        dt = g.t("cont", (dt_rank, ts, S), dt)
    dt = g.t("add", (d_inner, ts, S), g.t("mul_mat", (d_inner, ts, S), dt))
    xr = g.reshape(xc, (1, d_inner, ts, S))
    scan = g.t("ssm_scan", (d_inner * ts * S + d_state * d_inner * S,), xr, dt, b, c, s_copy[0])
    y_ssm = _rs(g, s_copy, d_state * d_inner, S, scan)
    g.expand(g.write("cpy", g.strided(y_ssm)))
    y = g.t("add", (d_inner, ts, S), g.reshape(y_ssm, (d_inner, ts, S)), g.t("mul", (d_inner, ts, S), xc))
    z = g.t("cont", (d_inner, ts, S), g.strided(xz))
    out = g.t("mul_mat", (x.layout[1], ts, S), g.t("glu", (d_inner, ts, S), z, y))
    return g.reshape(out, (x.layout[1], T))


def _mamba2_layer(m: GgufModel, g: Graph, x: Node, s_copy: tuple[Node, Node], n_embd_r: int, T: int, S: int,
                  il: int) -> Node:
    """src/models/mamba-base.cpp ``build_mamba2_layer`` (one state slot: ``n_rs_seq`` 0, K = 1)."""
    d_conv, d_inner = _int(m, ".ssm.conv_kernel"), _int(m, ".ssm.inner_size")
    d_state, n_head = _int(m, ".ssm.state_size"), _int(m, ".ssm.time_step_rank")
    n_group = _int(m, ".ssm.group_count")
    head_dim, conv_dim, ts = d_inner // n_head, d_inner + 2 * n_group * d_state, T // S
    d_in_proj = 2 * d_inner + 2 * n_group * d_state + n_head
    conv = g.reshape(_rs(g, s_copy, n_embd_r, S), (d_conv - 1, conv_dim, S))
    zx = g.reshape(g.t("mul_mat", (d_in_proj, T), x), (d_in_proj, ts, S))
    conv_x = g.t("concat", (d_conv - 1 + ts, conv_dim, S), conv, g.strided(g.strided(zx)))
    g.expand(g.write("cpy", g.strided(conv_x)))
    xbc = g.t("unary", (conv_dim, ts, S), g.t("add", (conv_dim, ts, S), g.t("ssm_conv", (conv_dim, ts, S), conv_x)))
    xs = g.strided(xbc)
    dt = g.t("add", (n_head, ts, S), g.t("cont", (n_head, ts, S), g.strided(zx)))
    scan = g.t("ssm_scan", (d_inner * ts * S + d_state * d_inner * S,), xs, dt, g.strided(xbc), g.strided(xbc),
               s_copy[0])
    y_ssm = _rs(g, s_copy, d_state * d_inner, S, scan)
    g.expand(g.write("cpy", g.strided(y_ssm)))
    shape = (head_dim, n_head, ts, S)
    y = g.t("add", shape, g.reshape(y_ssm, shape), g.t("mul", shape, xs))
    y = g.t("glu", shape, g.t("cont", shape, g.strided(zx)), y)
    if _has(m, f"blk.{il}.ssm_norm.weight"):
        y = _norm(g, g.reshape(y, (d_inner // n_group, n_group, ts, S)))
    return g.t("mul_mat", (x.layout[1], T), g.reshape(y, (d_inner, T)))


def mamba(m: GgufModel, h: Hparams, c: Context, n_tokens: int, n_outputs: int, layers: range,
          with_output: bool) -> Graph:
    """src/models/mamba.cpp (mamba and mamba2): per layer an RMS norm, the mixer, the residual."""
    g = Graph(lazy=True)
    T, E, S = n_tokens, h.n_embd, c.n_seq_max
    cur = _inputs(g, E, T)
    s_copy = _s_copy(g, S)
    out_ids = g.new_input((n_outputs,), I32)
    for il in layers:
        x = _norm(g, cur)
        if h.arch == "mamba2":
            y = _mamba2_layer(m, g, x, s_copy, h.memory.n_embd_r, T, S, il)
        else:
            y = _mamba_layer(m, g, x, s_copy, h.memory.n_embd_r, T, S)
        if il == h.n_layer - 1:
            y, cur = g.t("get_rows", (E, n_outputs), y, out_ids), g.t("get_rows", (E, n_outputs), cur, out_ids)
            T = n_outputs
        cur = g.t("add", (E, T), y, cur)
    _finish(g, cur, h.n_vocab, T, with_output)
    return g


def _s_copy(g: Graph, n_rs: int) -> tuple[Node, Node]:
    """``build_rs_inp``: the state copy ids, int32 per cell in use, viewed as this ubatch's and the rest."""
    s = g.new_input((n_rs,), I32)
    return g.strided(s), g.strided(s)


# ------------------------------------------------------------------------------------------- attention


def _kv_inputs(g: Graph, h: Hparams, c: Context, T: int) -> tuple[Node, Node, Node]:
    """``build_attn_inp_kv``: the K and V row indices (V transposed without flash attention: one index per value,
    ``n_embd_v_gqa_max`` of them a token) and the KQ mask, ``[n_kv, n_tokens / n_stream, 1, n_stream]``."""
    ns = c.n_stream
    v_max = max(h.n_embd_v_gqa(il) for il in range(h.n_layer))
    mask = g.new_input((c.n_ctx_seq, T // ns, 1, ns), F16 if c.flash_attn else F32)
    return g.new_input((T,), I64), g.new_input((T * (1 if c.flash_attn else v_max),), I64), mask


def _attention(g: Graph, h: Hparams, c: Context, x: Node, il: int, kv: tuple[Node, Node, Node],
               pos: Node | None, T: int, norms: bool = False) -> Node:
    """``build_qkv`` (separate q/k/v), per-head q / k norms where the model has them (lfm2), rope where it has it,
    :func:`_attend`, then the output projection."""
    H, Hkv, hd = h.n_head[il], h.n_head_kv[il], h.n_embd_head_k
    q = g.reshape(g.t("mul_mat", (H * hd, T), x), (hd, H, T))
    k = g.reshape(g.t("mul_mat", (Hkv * hd, T), x), (hd, Hkv, T))
    v = g.reshape(g.t("mul_mat", (Hkv * hd, T), x), (hd, Hkv, T))
    if norms:
        q, k = _norm(g, q), _norm(g, k)
    if pos is not None:
        q, k = g.t("rope", (hd, H, T), q, pos), g.t("rope", (hd, Hkv, T), k, pos)
    return g.t("mul_mat", (h.n_embd, T), _attend(g, c, q, k, v, kv, T))


def _attend(g: Graph, c: Context, q: Node, k: Node, v: Node, kv: tuple[Node, Node, Node], T: int) -> Node:
    """llama-graph.cpp ``build_attn`` over the KV cache (q, v, k expanded in that order, then their rows stored)
    and ``build_attn_mha``: flash attention, or KQ, soft_max and KQV; ``[head_dim x n_head, n_tokens]``."""
    hd, H = q.layout[1], q.layout[2]
    ns, n_kv = c.n_stream, c.n_ctx_seq
    k_idx, v_idx, mask = kv
    g.expand(q, v, k, g.write("set_rows", g.reshape(k, (prod(k.layout[1:3]), T)), k_idx),
             g.write("set_rows", g.reshape(v, (prod(v.layout[1:3]), T)), v_idx))
    qp = g.strided(g.strided(q))  # the per-stream view, permuted
    if c.flash_attn:
        att = g.reshape(g.t("flash_attn_ext", (hd, H, T // ns, ns), qp, mask), (hd * H, T))
    else:
        kq = g.t("soft_max", (n_kv, T // ns, H, ns), g.t("mul_mat", (n_kv, T // ns, H, ns), qp), mask)
        att = g.t("cont", (hd * H, T), g.strided(g.t("mul_mat", (hd, T // ns, H, ns), kq)))
    g.expand(att)
    return att


def _relu_sqr_ffn(g: Graph, x: Node, n_ff: int, T: int) -> Node:
    """``build_ffn`` RELU_SQR without a gate: up, relu, square (both in place), down."""
    up = g.t("mul_mat", (n_ff, T), x)
    return g.t("mul_mat", (x.layout[1], T), g.t("sqr", (n_ff, T), g.t("unary", (n_ff, T), up)))


def granitehybrid(m: GgufModel, h: Hparams, c: Context, n_tokens: int, n_outputs: int, layers: range,
                  with_output: bool) -> Graph:
    """src/models/granite-hybrid.cpp: a Mamba-2 mixer or attention per layer, then a dense feed-forward (or MoE),
    the residual multiplier as a scale where the GGUF gives one."""
    g = Graph(lazy=True)
    T, E, S = n_tokens, h.n_embd, c.n_seq_max
    recr = h.memory.recr_layers
    res_scale = float(m.get(".residual_scale", 0.0) or 0.0)
    cur = _inputs(g, E, T)
    s_copy = _s_copy(g, S)
    kv = _kv_inputs(g, h, c, T)
    out_ids = g.new_input((n_outputs,), I32)
    pos = g.new_input((T,), I32) if _int(m, ".rope.dimension_count") else None
    for il in layers:
        inp_sa, x = cur, _norm(g, cur)
        if recr[il]:
            y = _mamba2_layer(m, g, x, s_copy, h.memory.n_embd_r, T, S, il)
        else:
            y = _attention(g, h, c, x, il, kv, pos, T)
        if il == h.n_layer - 1:
            y, inp_sa = g.t("get_rows", (E, n_outputs), y, out_ids), g.t("get_rows", (E, n_outputs), inp_sa, out_ids)
            T = n_outputs
        if res_scale:
            y = g.t("scale", (E, T), y)
        ffn_inp = g.t("add", (E, T), y, inp_sa)
        x = _norm(g, ffn_inp)
        if h.n_expert:
            y = _moe(g, x, h.n_expert, h.n_expert_used, h.n_ff_exp or h.n_ff[il], T, True,
                     float(m.get(".expert_weights_scale", 0.0) or 0.0))
            n_shexp = _int(m, ".expert_shared_feed_forward_length")
            if n_shexp:
                y = g.t("add", (E, T), y, _ffn(g, x, n_shexp, T))
        else:
            y = _ffn(g, x, h.n_ff[il], T)
        if res_scale:
            y = g.t("scale", (E, T), y)
        cur = g.t("add", (E, T), y, ffn_inp)
    _finish(g, cur, h.n_vocab, T, with_output, logit_scale=bool(m.get(".logit_scale")))
    return g


def nemotron_h(m: GgufModel, h: Hparams, c: Context, n_tokens: int, n_outputs: int, layers: range,
               with_output: bool) -> Graph:
    """src/models/nemotron-h.cpp: per layer one of a Mamba-2 mixer, attention (no rope) or an MLP (relu
    squared), each after its own RMS norm, then the residual; the outputs' rows are taken after the final norm
    (``embeddings_nextn_masked`` is off by default, llama-context.cpp)."""
    g = Graph(lazy=True)
    T, E, S = n_tokens, h.n_embd, c.n_seq_max
    mem = h.memory
    cur = _inputs(g, E, T)
    s_copy = _s_copy(g, S)
    kv = _kv_inputs(g, h, c, T)
    out_ids = g.new_input((n_outputs,), I32)
    for il in layers:
        x = _norm(g, cur)
        if mem.recr_layers[il]:
            y = _mamba2_layer(m, g, x, s_copy, mem.n_embd_r, T, S, il)
        elif h.n_ff[il] == 0:
            y = _attention(g, h, c, x, il, kv, None, T)
        else:
            y = _relu_sqr_ffn(g, x, h.n_ff[il], T)
        cur = g.t("add", (E, T), y, cur)
    _finish(g, cur, h.n_vocab, T, with_output, rows=out_ids)
    return g


def jamba(m: GgufModel, h: Hparams, c: Context, n_tokens: int, n_outputs: int, layers: range,
          with_output: bool) -> Graph:
    """src/models/jamba.cpp: a Mamba (1) mixer where a layer has no KV heads, attention without rope elsewhere;
    then a dense feed-forward or MoE (softmax gating, weights not normalized)."""
    g = Graph(lazy=True)
    T, E, S = n_tokens, h.n_embd, c.n_seq_max
    cur = _inputs(g, E, T)
    s_copy = _s_copy(g, S)
    kv = _kv_inputs(g, h, c, T)
    out_ids = g.new_input((n_outputs,), I32)
    for il in layers:
        x = _norm(g, cur)
        if h.n_head_kv[il] == 0:
            y = _mamba_layer(m, g, x, s_copy, h.memory.n_embd_r, T, S)
        else:
            y = _attention(g, h, c, x, il, kv, None, T)
        if il == h.n_layer - 1:
            y, cur = g.t("get_rows", (E, n_outputs), y, out_ids), g.t("get_rows", (E, n_outputs), cur, out_ids)
            T = n_outputs
        ffn_inp = g.t("add", (E, T), cur, y)
        x = _norm(g, ffn_inp)
        if h.n_expert:
            y = _moe(g, x, h.n_expert, h.n_expert_used, h.n_ff_exp or h.n_ff[il], T, False,
                     float(m.get(".expert_weights_scale", 0.0) or 0.0))
        else:
            y = _ffn(g, x, h.n_ff[il], T)
        cur = g.t("add", (E, T), ffn_inp, y)
    _finish(g, cur, h.n_vocab, T, with_output)
    return g


def falcon_h1(m: GgufModel, h: Hparams, c: Context, n_tokens: int, n_outputs: int, layers: range,
              with_output: bool) -> Graph:
    """src/models/falcon-h1.cpp: every layer runs roped attention and a Mamba-2 mixer on the same input (normed
    twice: two nodes), adds them and the residual, then a dense feed-forward."""
    g = Graph(lazy=True)
    T, E, S = n_tokens, h.n_embd, c.n_seq_max
    cur = _inputs(g, E, T)
    pos = g.new_input((T,), I32)
    s_copy = _s_copy(g, S)
    kv = _kv_inputs(g, h, c, T)
    out_ids = g.new_input((n_outputs,), I32)
    for il in layers:
        att = _attention(g, h, c, _norm(g, cur), il, kv, pos, T)
        ssm = _mamba2_layer(m, g, _norm(g, cur), s_copy, h.memory.n_embd_r, T, S, il)
        ffn_inp = g.t("add", (E, T), g.t("add", (E, T), att, ssm), cur)
        if il == h.n_layer - 1:
            ffn_inp = g.t("get_rows", (E, n_outputs), ffn_inp, out_ids)
            T = n_outputs
        cur = g.t("add", (E, T), _ffn(g, _norm(g, ffn_inp), h.n_ff[il], T), ffn_inp)
    _finish(g, cur, h.n_vocab, T, with_output)
    return g


def _shortconv(m: GgufModel, g: Graph, x: Node, s_copy: tuple[Node, Node], n_embd_r: int, T: int, S: int) -> Node:
    """src/models/lfm2.cpp ``build_shortconv_block`` (causal, one state slot): in_proj into B, C, x; B * x
    through the short convolution after the cached columns; C times it; out_proj."""
    E = x.layout[1]
    d_conv, ts = _int(m, ".shortconv.l_cache") - 1, T // S
    bcx = g.t("mul_mat", (3 * E, ts, S), g.reshape(x, (E, ts, S)))
    bx = g.strided(g.t("mul", (E, ts, S), g.strided(bcx), g.strided(bcx)))  # transposed
    conv = g.reshape(_rs(g, s_copy, n_embd_r, S), (d_conv, E, S))
    bx = g.t("concat", (d_conv + ts, E, S), conv, bx)
    g.expand(g.write("cpy", g.strided(bx)))
    y = g.t("mul", (E, ts, S), g.strided(bcx), g.t("ssm_conv", (E, ts, S), bx))
    return g.reshape(g.t("mul_mat", (E, ts, S), y), (E, T))


def lfm2(m: GgufModel, h: Hparams, c: Context, n_tokens: int, n_outputs: int, layers: range,
         with_output: bool) -> Graph:
    """src/models/lfm2.cpp (without a sliding window): a short-convolution block or attention with q / k norms
    and rope per layer, then a dense feed-forward (MoE past ``leading_dense_block_count`` where the model has
    experts)."""
    g = Graph(lazy=True)
    T, E, S = n_tokens, h.n_embd, c.n_seq_max
    n_dense = _int(m, ".leading_dense_block_count", h.n_layer) if h.n_expert else h.n_layer
    cur = _inputs(g, E, T)
    s_copy = _s_copy(g, S)
    kv = _kv_inputs(g, h, c, T)
    pos = g.new_input((T,), I32)
    out_ids = g.new_input((n_outputs,), I32)
    for il in layers:
        x = _norm(g, cur)
        if h.memory.recr_layers[il]:
            y = _shortconv(m, g, x, s_copy, h.memory.n_embd_r, T, S)
        else:
            y = _attention(g, h, c, x, il, kv, pos, T, norms=True)
        if il == h.n_layer - 1:
            y, cur = g.t("get_rows", (E, n_outputs), y, out_ids), g.t("get_rows", (E, n_outputs), cur, out_ids)
            T = n_outputs
        cur = g.t("add", (E, T), cur, y)
        x = _norm(g, cur)
        if il >= n_dense:
            y = _moe(g, x, h.n_expert, h.n_expert_used, h.n_ff_exp or h.n_ff[il], T, True,
                     float(m.get(".expert_weights_scale", 0.0) or 0.0))
        else:
            y = _ffn(g, x, h.n_ff[il], T)
        cur = g.t("add", (E, T), cur, y)
    _finish(g, cur, h.n_vocab, T, with_output)
    return g


def _gated_attention(g: Graph, h: Hparams, c: Context, x: Node, il: int, kv: tuple[Node, Node, Node], pos: Node,
                     T: int) -> Node:
    """src/models/qwen3next.cpp ``build_layer_attn``: a query twice as wide (each head's query and its output
    gate), q / k norms, rope, attention, the output times sigmoid(gate), then ``attn_output``."""
    H, Hkv, hd = h.n_head[il], h.n_head_kv[il], h.n_embd_head_k
    q_full = g.reshape(g.t("mul_mat", (2 * hd * H, T), x), (2 * hd, H, T, 1))
    k = g.reshape(g.t("mul_mat", (hd * Hkv, T), x), (hd, Hkv, T))
    v = g.reshape(g.t("mul_mat", (hd * Hkv, T), x), (hd, Hkv, T))
    q = g.t("rope", (hd, H, T, 1), _norm(g, g.strided(q_full), (hd, H, T, 1)), pos)
    k = g.t("rope", (hd, Hkv, T), _norm(g, k), pos)
    att = _attend(g, c, q, k, v, kv, T)
    gate = g.t("unary", (hd * H, T), g.t("cont", (hd * H, T), g.strided(q_full)))  # sigmoid
    return g.t("mul_mat", (h.n_embd, T), g.t("mul", (hd * H, T), att, gate))


def _gated_delta_net(m: GgufModel, g: Graph, x: Node, s_copy: tuple[Node, Node], n_embd_r: int, n_embd_s: int,
                     T: int, S: int) -> Node:
    """src/models/qwen3next.cpp ``build_layer_attn_linear`` with ggml's fused ``gated_delta_net`` (one state
    slot: delta-net-base.cpp ``build_delta_net_fused``, as resolve_fused_ops picks on the CPU): the q, k, v and z
    projections split out of ``ssm_in`` and made contiguous, beta and the decay gate from ``ssm_ba``, the short
    convolution over q, k, v after the cached columns, l2-normed q and k repeated to the value heads, the delta
    rule, a gated RMS norm by silu(z), then ``ssm_out``."""
    E = x.layout[1]
    d_inner, hk = _int(m, ".ssm.inner_size"), _int(m, ".ssm.state_size")
    nk, nv, d_conv = _int(m, ".ssm.group_count"), _int(m, ".ssm.time_step_rank"), _int(m, ".ssm.conv_kernel")
    hv, ts = d_inner // nv, T // S
    key_dim, channels = hk * nk, d_inner + 2 * nk * hk
    qkvz = g.t("mul_mat", (2 * key_dim + 2 * d_inner, T), x)
    z = g.t("cont", (d_inner // nk, nk, ts, S), g.strided(qkvz))
    qf = g.t("cont", (key_dim, ts, S), g.strided(qkvz))
    kf = g.t("cont", (key_dim, ts, S), g.strided(qkvz))
    vf = g.t("cont", (d_inner, ts, S), g.strided(qkvz))
    qkv = g.t("concat", (channels, ts, S), g.t("concat", (2 * key_dim, ts, S), qf, kf), vf)
    ba = g.t("mul_mat", (2 * nv, T), x)
    beta = g.reshape(g.t("unary", (nv // nk, nk, ts, S), g.t("cont", (nv // nk, nk, ts, S), g.strided(ba))),
                     (1, nv, ts, S))  # sigmoid
    alpha = g.t("add", (nv, ts, S), g.t("cont", (nv, ts, S), g.strided(ba)))
    gate = g.reshape(g.t("mul", (nv, ts, S), g.t("unary", (nv, ts, S), alpha)), (1, nv, ts, S))  # softplus x A
    conv = g.reshape(_rs(g, s_copy, n_embd_r, S), (d_conv - 1, channels, S))
    conv_in = g.t("concat", (d_conv - 1 + ts, channels, S), conv, g.strided(qkv))
    g.expand(g.write("cpy", g.strided(conv_in)))
    state = g.reshape(_rs(g, s_copy, n_embd_s, S), (hv, hv, nv, S))
    mixed = g.t("unary", (channels, ts, S), g.t("ssm_conv", (channels, ts, S), conv_in))  # silu

    def l2(view: Node) -> Node:  # models.h build_gdn_l2_norm: rms_norm, then a scale
        out = g.t("scale", (hk, nk, ts, S), g.t("rms_norm", (hk, nk, ts, S), view))
        if nk != nv:
            rep = g.t("repeat", (hk, nv // nk, nk, T), g.reshape(out, (hk, 1, nk, T)))
            out = g.reshape(rep, (hk, nv, ts, S))
        return out

    q, k = l2(g.strided(mixed)), l2(g.strided(mixed))
    gdn = g.t("gated_delta_net", (hv * nv * ts * S + hv * hv * nv * S,), q, k, g.strided(mixed), gate, beta, state)
    g.expand(g.write("cpy", g.strided(gdn)))
    normed = _norm(g, g.strided(gdn), (hv, nv, ts, S))
    y = g.t("mul", (hv, nv, ts, S), normed, g.t("unary", (hv, nv, ts, S), g.reshape(z, (hv, nv, ts, S))))
    return g.reshape(g.t("mul_mat", (E, ts, S), g.reshape(y, (d_inner, ts, S))), (E, T))


def qwen3next(m: GgufModel, h: Hparams, c: Context, n_tokens: int, n_outputs: int, layers: range,
              with_output: bool) -> Graph:
    """src/models/qwen3next.cpp: gated delta-net layers and gated full attention, each after an RMS norm, the
    residual, a post-attention norm, MoE with a sigmoid-gated shared expert; the outputs' rows are taken after
    the final norm (``embeddings_nextn_masked`` off by default)."""
    g = Graph(lazy=True)
    T, E, S = n_tokens, h.n_embd, c.n_seq_max
    mem = h.memory
    cur = _inputs(g, E, T)
    s_copy = _s_copy(g, S)
    kv = _kv_inputs(g, h, c, T)
    pos = g.new_input((T,), I32)
    out_ids = g.new_input((n_outputs,), I32)
    n_shexp = _int(m, ".expert_shared_feed_forward_length")
    for il in (il for il in layers if il < h.n_layer - mem.n_layer_nextn):
        x = _norm(g, cur)
        g.expand(x)
        if mem.recr_layers[il]:
            y = _gated_delta_net(m, g, x, s_copy, mem.n_embd_r, mem.n_embd_s, T, S)
        else:
            y = _gated_attention(g, h, c, x, il, kv, pos, T)
        res = g.t("add", (E, T), y, cur)
        x = _norm(g, res)
        if h.n_expert:
            y = _moe(g, x, h.n_expert, h.n_expert_used, h.n_ff_exp or h.n_ff[il], T, True, 0.0)
            if n_shexp:
                shared = g.t("mul", (E, T), _ffn(g, x, n_shexp, T),
                             g.t("unary", (1, T), g.t("mul_mat", (1, T), x)))  # sigmoid(ffn_gate_inp_shexp x)
                y = g.t("add", (E, T), y, shared)
        else:
            y = _ffn(g, x, h.n_ff[il], T)
        cur = g.t("add", (E, T), y, res)
    _finish(g, cur, h.n_vocab, T, with_output, rows=out_ids)
    return g


# ------------------------------------------------------------------------------------------------ rwkv


def _layer_norm(g: Graph, x: Node, ne: tuple[int, ...] | None = None) -> Node:
    """``build_norm`` LLM_NORM with weight and bias: ggml_norm (never in place), mul, add."""
    ne = ne or x.layout[1:]
    return g.t("add", ne, g.t("mul", ne, g.t("norm", ne, x)))


def _token_shift(g: Graph, s_copy: tuple[Node, Node], E: int, n_embd_r: int, S: int) -> Node:
    """llama-graph.cpp ``build_rwkv_token_shift_load``: each sequence's last attention and feed-forward inputs."""
    return g.reshape(_rs(g, s_copy, n_embd_r, S), (E, n_embd_r // E, S))


def _shifted(g: Graph, shift: Node, x: Node, E: int, ts: int, S: int) -> Node:
    """The previous token's values: the stored shift, then all but the last of ``x`` (a concat along tokens)."""
    return g.t("concat", (E, ts, S), g.strided(shift), g.strided(x))


def _rwkv6_time_mix(m: GgufModel, g: Graph, x: Node, x_prev: Node, s_copy: tuple[Node, Node], n_embd_s: int,
                    T: int, S: int) -> Node:
    """src/models/rwkv6-base.cpp ``build_rwkv6_time_mix`` (RWKV-6, the fused lerp): the data-dependent token
    shift through ``time_mix_w1`` / ``w2``, r / k / v / gate projections, the decay through its own low rank,
    ``rwkv_wkv6`` over the state, a per-head group norm, the gate, ``time_mix_output``."""
    E, hs = x.layout[1], _int(m, ".wkv.head_size")
    H, mix = E // hs, _int(m, ".time_mix_extra_dim")
    decay = _int(m, ".time_decay_extra_dim")
    ts = T // S
    sx = g.t("sub", (E, ts, S), x_prev, x)
    xxx = g.t("add", (E, T), g.t("mul", (E, T), g.reshape(sx, (E, T))), g.reshape(x, (E, T)))
    xxx = g.t("unary", (5 * mix, T), g.t("mul_mat", (5 * mix, T), xxx))  # tanh
    xxx = g.t("cont", (mix, 1, T, 5), g.strided(g.reshape(xxx, (mix, 1, 5, T))))
    xxx = g.t("mul_mat", (E, 1, T, 5), xxx)
    xxx = g.t("add", (E, 1, T, 5), g.t("mul", (E, 1, T, 5), g.t("add", (E, 1, T, 5), xxx), g.reshape(sx, (E, 1, T))),
              g.reshape(x, (E, 1, T)))
    xw, xk, xv, xr, xg = (g.strided(xxx) for _ in range(5))
    r = g.reshape(g.t("mul_mat", (E, T), xr), (hs, H, T))
    k = g.reshape(g.t("mul_mat", (E, T), xk), (hs, H, T))
    v = g.reshape(g.t("mul_mat", (E, T), xv), (hs, H, T))
    gate = g.t("unary", (E, T), g.t("mul_mat", (E, T), xg))  # silu
    w = g.t("mul_mat", (E, T), g.t("unary", (decay, T), g.t("mul_mat", (decay, T), xw)))
    w = g.t("unary", (E, T), g.t("unary", (E, T), g.t("unary", (E, T), g.t("add", (E, T), w))))  # exp(-exp(w))
    state = _rs(g, s_copy, n_embd_s, S)
    wkv = g.t("rwkv_wkv6", (E, T + hs * S), k, v, r, g.reshape(w, (hs, H, T)), state)
    g.expand(g.write("cpy", g.strided(wkv)))
    y = g.t("norm", (hs, H, T), g.reshape(g.strided(wkv), (hs, H, T)))
    y = g.t("mul", (E, T), g.t("add", (E, T), g.t("mul", (E, T), g.reshape(y, (E, T)))), gate)
    return g.reshape(g.t("mul_mat", (E, T), y), (E, ts, S))


def rwkv6(m: GgufModel, h: Hparams, c: Context, n_tokens: int, n_outputs: int, layers: range,
          with_output: bool) -> Graph:
    """src/models/rwkv6.cpp: a layer-normed embedding; per layer the time mix and the channel mix (relu-squared
    key, sigmoid receptance), each fed the previous token through the stored token shift, which is written back;
    the last layer keeps the outputs' rows before its channel mix; a scale by 1/2 every
    ``rescale_every_n_layers``."""
    def time_mix(g, x, x_prev, s_copy, n_embd_s, T, S, il):
        return _rwkv6_time_mix(m, g, x, x_prev, s_copy, n_embd_s, T, S)

    return _rwkv_layers(h, c, n_tokens, n_outputs, layers, with_output, time_mix, _rwkv6_channel_mix,
                        _int(m, ".rescale_every_n_layers"))


def _rwkv_layers(h: Hparams, c: Context, n_tokens: int, n_outputs: int, layers: range, with_output: bool,
                 time_mix, channel_mix, rescale: int = 0) -> Graph:
    """The layer skeleton rwkv6 and rwkv7 share (src/models/rwkv6-base.cpp, rwkv7-base.cpp): the token shift
    read, the time mix and the channel mix each on the previous token, the shift written back, the outputs'
    rows taken before the last channel mix."""
    g = Graph(lazy=True)
    T, E, S = n_tokens, h.n_embd, c.n_seq_max
    ts, mem = T // S, h.memory
    cur = _layer_norm(g, _inputs(g, E, T))
    s_copy = _s_copy(g, S)
    out_ids = g.new_input((n_outputs,), I32)
    for il in layers:
        inp = g.reshape(cur, (E, ts, S))
        shift = _token_shift(g, s_copy, E, mem.n_embd_r, S)
        att_norm = _layer_norm(g, inp)
        att = time_mix(g, att_norm, _shifted(g, shift, att_norm, E, ts, S), s_copy, mem.n_embd_s, T, S, il)
        ffn_inp = g.t("add", (E, ts, S), att, inp)
        ffn_norm = _layer_norm(g, ffn_inp)
        x_prev = _shifted(g, shift, ffn_norm, E, ts, S)
        shift_out = g.t("concat", (E, 2, S), g.strided(att_norm), g.strided(ffn_norm))
        g.expand(g.write("cpy", g.strided(shift_out)))
        ffn_inp, ffn_norm, x_prev = (g.reshape(t, (E, T)) for t in (ffn_inp, ffn_norm, x_prev))
        if il == h.n_layer - 1:
            ffn_inp, ffn_norm, x_prev = (g.t("get_rows", (E, n_outputs), t, out_ids)
                                         for t in (ffn_inp, ffn_norm, x_prev))
            T = n_outputs
        cur = g.t("add", (E, T), channel_mix(g, ffn_norm, x_prev, h.n_ff[il], T), ffn_inp)
        if rescale and (il + 1) % rescale == 0:
            cur = g.t("scale", (E, T), cur)
    _finish_layer_norm(g, cur, h.n_vocab, T, with_output)
    return g


def _rwkv6_channel_mix(g: Graph, x: Node, x_prev: Node, n_ff: int, T: int) -> Node:
    """src/models/rwkv6-base.cpp ``build_rwkv6_channel_mix``."""
    E = x.layout[1]
    sx = g.t("sub", (E, T), x_prev, x)
    xk = g.t("add", (E, T), g.t("mul", (E, T), sx), x)
    xr = g.t("add", (E, T), g.t("mul", (E, T), sx), x)
    r = g.t("unary", (E, T), g.t("mul_mat", (E, T), xr))  # sigmoid
    k = g.t("sqr", (n_ff, T), g.t("unary", (n_ff, T), g.t("mul_mat", (n_ff, T), xk)))  # relu, squared
    return g.t("mul", (E, T), r, g.t("mul_mat", (E, T), k))


def _finish_layer_norm(g: Graph, x: Node, n_vocab: int, T: int, with_output: bool) -> None:
    """The output layer after a layer norm with bias (the rwkv family)."""
    if not with_output:
        g.expand(x)
        return
    logits = g.t("mul_mat", (n_vocab, T), _layer_norm(g, x))
    logits.is_output = True
    g.expand(logits)


def _rwkv7_time_mix(m: GgufModel, g: Graph, x: Node, x_prev: Node, v_first: Node | None,
                    s_copy: tuple[Node, Node], n_embd_s: int, T: int, S: int, il: int) -> tuple[Node, Node]:
    """src/models/rwkv7-base.cpp ``build_rwkv7_time_mix``: the token shift repeated over the five (six with a
    gate) fused lerps (``ggml_repeat`` takes only the dummy's shape: it is no source, and not in the graph),
    the low-rank decay, in-context learning rate, value-residual (every layer but the first
    mixes in the first layer's value) and gate, ``rwkv_wkv7`` over the state, the group norm, the r.k bonus, the
    gate, ``time_mix_output``. Returns the output and the first layer's value."""
    E, hs = x.layout[1], _int(m, ".wkv.head_size")
    H, ts = E // hs, T // S
    gated = _has(m, f"blk.{il}.time_mix_g1.weight")
    lora = {k: _int(m, f".attention.{k}_lora_rank") for k in ("decay", "iclr", "value_residual_mix", "gate")}
    n_mix = 6 if gated else 5
    sx = g.t("repeat", (E, ts, S, n_mix), g.t("sub", (E, ts, S), x_prev, x))
    xxx = g.t("add", (E, ts, S, n_mix), g.t("mul", (E, ts, S, n_mix), sx), x)
    xr, xw, xk, xv, xa = (g.strided(xxx) for _ in range(5))
    r = g.t("mul_mat", (E, T), xr)
    w = g.t("mul_mat", (E, T), g.t("unary", (lora["decay"], T), g.t("mul_mat", (lora["decay"], T), xw)))
    w = g.t("unary", (E, T), g.t("scale", (E, T), g.t("unary", (E, T), g.t("add", (E, T), w))))  # exp(-k sigmoid)
    k = g.t("mul_mat", (E, T), xk)
    v = g.t("mul_mat", (E, T), xv)
    if v_first is None:
        v_first = v
    else:
        mix = g.t("mul_mat", (E, T), g.t("mul_mat", (lora["value_residual_mix"], T), xv))
        v = g.t("add", (E, T), v, g.t("mul", (E, T), g.t("sub", (E, T), v_first, v),
                                      g.t("unary", (E, T), g.t("add", (E, T), mix))))
    gate = None
    if gated:
        lo = g.t("unary", (lora["gate"], T), g.t("mul_mat", (lora["gate"], T), g.strided(xxx)))
        gate = g.t("mul_mat", (E, T), lo)
    a = g.t("mul_mat", (E, T), g.t("mul_mat", (lora["iclr"], T), xa))
    a = g.t("unary", (E, T), g.t("add", (E, T), a))  # sigmoid
    kk = g.t("l2_norm", (hs, H, T), g.reshape(g.t("mul", (E, T), k), (hs, H, T)))
    ka = g.t("mul", (E, T), k)
    k = g.t("add", (E, T), k, g.t("sub", (E, T), g.t("mul", (E, T), a, ka), ka))
    r3, w3, k3, v3, a3 = (g.reshape(t, (hs, H, T)) for t in (r, w, k, v, a))
    state = _rs(g, s_copy, n_embd_s, S)
    wkv = g.t("rwkv_wkv7", (E, T + hs * S), r3, w3, k3, v3, g.t("unary", (hs, H, T), kk),
              g.t("mul", (hs, H, T), kk, a3), state)
    g.expand(g.write("cpy", g.strided(wkv)))
    y = g.t("norm", (hs, H, T), g.reshape(g.strided(wkv), (hs, H, T)))
    y = g.t("add", (E, T), g.t("mul", (E, T), g.reshape(y, (E, T))))
    rk = g.t("sum_rows", (1, H, T), g.t("mul", (hs, H, T), g.t("mul", (hs, H, T), k3, r3)))
    y = g.t("add", (E, T), y, g.reshape(g.t("mul", (hs, H, T), v3, rk), (E, T)))
    if gate is not None:
        y = g.t("mul", (E, T), y, gate)
    return g.reshape(g.t("mul_mat", (E, T), y), (E, ts, S)), v_first


def rwkv7(m: GgufModel, h: Hparams, c: Context, n_tokens: int, n_outputs: int, layers: range,
          with_output: bool) -> Graph:
    """src/models/rwkv7.cpp: as rwkv6 (:func:`rwkv6`), with RWKV-7's time mix (its first layer's values carried
    to every later one) and a channel mix of a relu-squared key alone."""
    v_first: list = [None]

    def time_mix(g, x, x_prev, s_copy, n_embd_s, T, S, il):
        att, v_first[0] = _rwkv7_time_mix(m, g, x, x_prev, v_first[0], s_copy, n_embd_s, T, S, il)
        return att

    return _rwkv_layers(h, c, n_tokens, n_outputs, layers, with_output, time_mix, _rwkv7_channel_mix)


def _rwkv7_channel_mix(g: Graph, x: Node, x_prev: Node, n_ff: int, T: int) -> Node:
    """rwkv7-base.cpp build_rwkv7_channel_mix: a lerp to the previous token, then a relu-squared key."""
    E = x.layout[1]
    xk = g.t("add", (E, T), g.t("mul", (E, T), g.t("sub", (E, T), x_prev, x)), x)
    k = g.t("sqr", (n_ff, T), g.t("unary", (n_ff, T), g.t("mul_mat", (n_ff, T), xk)))  # relu, squared
    return g.t("mul_mat", (E, T), k)


def build(m: GgufModel, h: Hparams, c: Context, n_tokens: int, n_outputs: int, layers: range,
          with_output: bool) -> Graph:
    """The graph of a ubatch of ``n_tokens`` (llama-context.cpp ``graph_reserve``: rounded up to a multiple of
    ``n_seq_max``, each sequence an equal share) with ``n_outputs`` outputs."""
    n_tokens = -(-n_tokens // c.n_seq_max) * c.n_seq_max
    return BUILDERS[h.arch](m, h, c, n_tokens, n_outputs, layers, with_output)


# the vendored source each builder follows (src/models/), for the estimate's method line and docs/llamacpp.md
SOURCES = {"deepseek2": "deepseek2.cpp", "mamba": "mamba.cpp, mamba-base.cpp", "mamba2": "mamba.cpp, mamba-base.cpp",
           "granitehybrid": "granite-hybrid.cpp", "nemotron_h": "nemotron-h.cpp", "jamba": "jamba.cpp",
           "falcon-h1": "falcon-h1.cpp", "lfm2": "lfm2.cpp", "qwen3next": "qwen3next.cpp, delta-net-base.cpp",
           "rwkv6": "rwkv6.cpp, rwkv6-base.cpp", "rwkv7": "rwkv7.cpp, rwkv7-base.cpp"}
BUILDERS = {"deepseek2": deepseek2_mla, "mamba": mamba, "mamba2": mamba, "granitehybrid": granitehybrid,
            "nemotron_h": nemotron_h, "jamba": jamba, "falcon-h1": falcon_h1, "lfm2": lfm2,
            "qwen3next": qwen3next, "rwkv6": rwkv6,
            "rwkv7": rwkv7}
