"""The compute buffers: llama.cpp's graph reservation, replayed.

At context creation llama.cpp builds its worst-case graph -- one ubatch of ``n_ubatch`` tokens (and one
of ``n_seq_max`` tokens), every KV cell in view -- and has ggml's graph allocator place every
intermediate tensor (llama-context.cpp ``sched_reserve`` -> ``graph_reserve`` ->
``ggml_backend_sched_reserve``). The compute buffer is the highest offset that allocator reaches:
``ggml_dyn_tallocr`` (ggml-alloc.c), best fit among freed blocks, else the end of the buffer; a tensor
is freed when its last consumer ran; an op that ggml may run in place (``ggml_op_can_inplace``: ADD,
MUL, RMS_NORM, ROPE, SOFT_MAX, UNARY ...) takes its parent's memory when it is the parent's only
consumer and the parent is not a view (:func:`.ggml_graph._allocate`).

Here the same graph is written down node by node for the llama family of decoders (src/models/llama.cpp
and the gemma2/gemma3 variants with their extra norms, scaling and soft-capping; dense or MoE feed
forward; flash attention or KQ + soft_max; a quantized cache's Hadamard rotations), with each tensor's
ggml shape and type, and the same allocator is run over it (:mod:`.ggml_graph`). Inputs (tokens,
positions, the KQ mask -- f16 with flash attention, f32 without --, the KV row indices) are allocated
first, as ggml allocates graph inputs.

The recurrent, hybrid and MLA architectures (deepseek2 with MLA, mamba, mamba2, granitehybrid, nemotron_h,
jamba, falcon-h1, lfm2, qwen3next, rwkv6, rwkv7) have graphs of their own, written down in :mod:`.graphs`
from their source files and built in ggml's own node order; on tiny models each equals llama.cpp's CPU
reservation to the log's 0.01 MiB (tests/test_llamacpp.py). The rest of the recurrent and MLA family
(lfm2moe, nemotron_h_moe, qwen35, qwen35moe, rwkv6qwen2, arwkv7, an MLA GGUF without ``q_lora_rank``) is
priced as the llama family's graph over the same widths, and the notes say it is approximate.

Where the graph runs on several devices (a partial -ngl, several GPUs) ggml's scheduler cuts it into
splits per backend and copies tensors between them; that is priced as each device's own layers'
graph, plus the graph inputs the scheduler keeps on the GPU host (``CUDA_Host``, :func:`host_inputs`).
Against published CUDA, Vulkan and Metal logs (docs/validation.md, the llama.cpp section) a full offload's
GPU buffer is within 3 % wherever the build lays the cache and the ubatch out as today's (2024 builds and a
shared multi-sequence cache differ, and gpt-oss, whose own nodes are not replayed, is 4 % under); a partial
offload's, and the scheduler's copies between devices (and pipeline parallelism's), remain approximate and the
notes say so.
"""

from __future__ import annotations

from .buffers import Context, Hparams, LlamaArgs, Placement, attn_rotation, swa_cells
from .ggml_buffers import CPU_ALIGN, CUDA_ALIGN
from . import graphs
from .ggml_graph import F16, F32, I32, I64, Graph, Node, input_bytes, run_allocator
from .gguf_file import GgufModel

GRAPH_ARCHS = ("llama", "gemma2", "gemma3", "qwen2", "qwen3", "mistral3", "qwen3moe", "qwen2moe", "granite", "phi3")


# ------------------------------------------------------------------------------------------------ graph

def build_graph(m: GgufModel, h: Hparams, a: LlamaArgs, c: Context, n_tokens: int, n_outputs: int,
                layers: range | None = None, with_output: bool = True) -> Graph:
    """The worst-case graph llama.cpp reserves (src/models/llama.cpp, gemma2.cpp, gemma3.cpp; llama-graph.cpp
    ``build_attn_mha``, ``build_ffn``, ``build_moe_ffn``), with ``n_tokens`` tokens and every KV cell."""
    g = Graph()
    T, E = n_tokens, h.n_embd
    fa = c.flash_attn
    gemma = h.arch in ("gemma2", "gemma3")
    tokens = g.input(T * I32)
    # build_inp_embd puts both inputs in the graph (ggml_build_forward_select): the token ids and an
    # [n_embd, n_tokens] f32 embeddings input that nothing consumes when tokens are given -- allocated first
    # and never freed, as every graph input is
    g.input(E * T * F32)
    pos = g.input(T * I32)
    n_kv_base = c.n_ctx_seq
    n_kv_swa = swa_cells(h, a, c)
    swa = n_kv_swa is not None
    streams = c.n_stream
    per_stream = T // streams if T % streams == 0 else T

    def mask(n_kv: int) -> Node:
        return g.input(n_kv * per_stream * streams * (F16 if fa else F32))

    # graph inputs in the order ggml's graph walk meets them (its leafs): tokens, positions, then for each cache
    # in the order of its first layer (a sliding-window model's first layer is a window layer) the rotation
    # matrices of a quantized cache at its first Q, its KV row indices at its first set_rows and its mask at
    # its first attention; out_ids at the last layer
    v_max = max((h.n_embd_v_gqa(il) for il in range(h.n_layer)), default=0)
    keys = ["swa", "base"] if swa and h.is_swa[0] else ["base", "swa"] if swa else ["base"]
    rot_k, rot_v = attn_rotation(h, a)
    rots, idx, masks = {}, {}, {}
    for key in keys:
        rots[key] = (g.input(rot_k * rot_k * F32) if rot_k else None, g.input(rot_v * rot_v * F32) if rot_v else None)
        idx[key] = (g.input(T * I64), g.input(T * (1 if fa else v_max) * I64))
        masks[key] = mask(n_kv_swa if key == "swa" else n_kv_base)
    inp = g.op("get_rows", E * T * F32, tokens)
    if gemma:
        inp = g.op("scale", E * T * F32, inp)
    out_ids = g.input(n_outputs * I32)  # always built (llama-graph.cpp build_inp_out_ids: constant topology)
    cur = inp
    n_layers = range(h.n_layer) if layers is None else layers
    last = h.n_layer - 1

    def rotated(x: Node, rot: Node | None) -> Node:
        """llama_mul_mat_hadamard: the rotation times a 2-d reshape of ``x``, reshaped back."""
        return x if rot is None else g.view(g.op("mul_mat", x.nbytes, rot, g.view(x)))

    for il in n_layers:
        key = "swa" if h.is_swa[il] else "base"
        n_kv = n_kv_swa if key == "swa" else n_kv_base
        hq, hkv = h.n_head[il], h.n_head_kv[il]
        hd_k, hd_v = h.n_embd_head_k, h.n_embd_head_v
        k_rot, v_rot = rots[key]
        inp_sa = cur
        x = g.op("rms_norm", E * T * F32, cur)
        x = g.op("mul", E * T * F32, x)
        # the order ggml_build_forward_expand leaves them in (GGML_SCHED_DEBUG=2): Q with its norm, rope and
        # rotation; then V and K (build_attn expands q, v, k), or K and V with a sliding-window cache (the
        # iswa build_attn expands q, k, v)
        q = g.op("mul_mat", hq * hd_k * T * F32, x)
        qv = g.view(q)
        if h.arch == "gemma3":
            qv = g.op("rms_norm", qv.nbytes, qv)
            qv = g.op("mul", qv.nbytes, qv)
        qr = g.op("rope", qv.nbytes, qv, pos)
        if gemma:
            qr = g.op("scale", qr.nbytes, qr)
        qr = rotated(qr, k_rot)

        def v_proj() -> Node:
            return rotated(g.view(g.op("mul_mat", hkv * hd_v * T * F32, x)), v_rot)

        def k_proj() -> Node:
            kv = g.view(g.op("mul_mat", hkv * hd_k * T * F32, x))
            if h.arch == "gemma3":
                kv = g.op("rms_norm", kv.nbytes, kv)
                kv = g.op("mul", kv.nbytes, kv)
            return rotated(g.op("rope", kv.nbytes, kv, pos), k_rot)

        if swa:
            kr = k_proj()
            vv = v_proj()
        else:
            vv = v_proj()
            kr = k_proj()
        k_idx, v_idx = idx[key]
        g.op("set_rows", 0, kr, k_idx)  # into the cache: a view of it, nothing allocated
        g.op("set_rows", 0, g.view(vv), v_idx)
        qp = g.view(qr)
        if fa:
            att = g.op("flash_attn_ext", hd_v * hq * T * F32, qp, masks[key])
            att = g.view(att)
        else:
            kq = g.op("mul_mat", n_kv * T * hq * F32, qp)
            if h.arch == "gemma2":
                kq = g.op("scale", kq.nbytes, kq)
                kq = g.op("unary", kq.nbytes, kq)
                kq = g.op("scale", kq.nbytes, kq)
            kq = g.op("soft_max", kq.nbytes, kq, masks[key])
            kqv = g.op("mul_mat", hd_v * T * hq * F32, kq)
            kqv = g.view(kqv)
            att = g.op("cont", hd_v * hq * T * F32, kqv)
        att = rotated(att, v_rot)
        o = g.op("mul_mat", E * T * F32, att)
        if il == last:  # the output rows: of the attention's output before gemma's post-attention norm
            # (gemma2.cpp, gemma3.cpp), then of the residual, as the walk meets them from the add
            T = n_outputs
            o = g.op("get_rows", E * T * F32, o, out_ids)
        if gemma:
            o = g.op("rms_norm", E * T * F32, o)
            o = g.op("mul", E * T * F32, o)
        if il == last:
            inp_sa = g.op("get_rows", E * T * F32, inp_sa, out_ids)
        ffn_inp = g.op("add", E * T * F32, o, inp_sa)
        x = g.op("rms_norm", E * T * F32, ffn_inp)
        x = g.op("mul", E * T * F32, x)
        F = h.n_ff[il]
        if h.n_expert:
            F = h.n_ff_exp or F  # qwen2moe / qwen3moe / gpt-oss read expert_feed_forward_length (llama-model.cpp)
            k_used, n_exp = h.n_expert_used, h.n_expert
            logits = g.op("mul_mat", n_exp * T * F32, x)
            probs = g.op("soft_max", logits.nbytes, logits)
            sel = g.op("argsort_top_k", k_used * T * I32, probs)
            w = g.op("get_rows", k_used * T * F32, g.view(probs), sel)
            if h.arch in ("qwen3moe", "qwen2moe", "llama"):
                wsum = g.op("sum_rows", T * F32, g.view(w))
                w = g.op("div", w.nbytes, w, wsum)
            up = g.op("mul_mat_id", F * k_used * T * F32, x, sel)
            gate = g.op("mul_mat_id", F * k_used * T * F32, x, sel)
            act = g.op("glu", F * k_used * T * F32, gate, up)
            down = g.op("mul_mat_id", E * k_used * T * F32, act, sel)
            down = g.op("mul", down.nbytes, down, w)
            views = [g.view(down) for _ in range(k_used)]
            acc = views[0]
            for vw in views[1:]:
                acc = g.op("add", E * T * F32, acc, vw)
            y = acc
        else:
            up = g.op("mul_mat", F * T * F32, x)
            gate = g.op("mul_mat", F * T * F32, x)
            act = g.op("glu", F * T * F32, gate, up)
            y = g.op("mul_mat", E * T * F32, act)
        if gemma:
            y = g.op("rms_norm", y.nbytes, y)
            y = g.op("mul", y.nbytes, y)
        cur = g.op("add", E * T * F32, y, ffn_inp)
    if with_output:
        x = g.op("rms_norm", E * T * F32, cur)
        x = g.op("mul", E * T * F32, x)
        logits = g.op("mul_mat", h.n_vocab * T * F32, x)
        if h.arch == "gemma2" or (h.arch == "gemma3" and m.get(".final_logit_softcapping")):
            logits = g.op("scale", logits.nbytes, logits)
            logits = g.op("unary", logits.nbytes, logits)
            logits = g.op("scale", logits.nbytes, logits)
        logits.is_output = True
    return g


def host_inputs(h: Hparams, a: LlamaArgs, c: Context, n_tokens: int, n_outputs: int) -> int:
    """The GPU host's compute buffer when the layers are on the GPU: ggml's scheduler assigns every tensor
    flagged as a graph input to the last backend, the CPU (ggml-backend.c ``ggml_backend_sched_split_graph``),
    and copies it to the GPU from there; the token embeddings' ``get_rows`` runs beside ``token_embd``, which
    stays on the CPU. So the host holds: the token ids and positions, the embeddings ``[n_embd, n_tokens]``
    f32, the KV row indices, each KQ mask as llama-graph.cpp creates it -- f32 ``[n_kv, n_tokens]`` (flash
    attention casts it to f16 on the device) --, the rotation matrices of a quantized cache
    (:func:`.buffers.attn_rotation`), and the output ids. Inputs are never freed, so the buffer
    is their sum, each aligned to 32 bytes. Checked against published CUDA, Vulkan and Metal logs
    (docs/validation.md, the llama.cpp section): equal to the log's 0.01 MiB on builds from late 2025; older
    builds (before ``set_rows``, mid-2025) had no index inputs, which is up to ``n_tokens x n_embd_v_gqa``
    int64 less without flash attention."""
    T = n_tokens
    pad = lambda n: -(-n // CPU_ALIGN) * CPU_ALIGN  # noqa: E731
    total = pad(T * I32) * 2 + pad(h.n_embd * T * F32) + pad(n_outputs * I32)
    v_max = max((h.n_embd_v_gqa(il) for il in range(h.n_layer)), default=0)
    cells = [n for n in (c.n_ctx_seq, swa_cells(h, a, c)) if n is not None]
    per_stream = T // c.n_stream if T % c.n_stream == 0 else T
    rot_k, rot_v = attn_rotation(h, a)
    for n_kv in cells:
        total += pad(n_kv * per_stream * c.n_stream * F32)
        total += pad(T * I64) + pad(T * (1 if c.flash_attn else v_max) * I64)
        total += pad(rot_k * rot_k * F32) + pad(rot_v * rot_v * F32)  # 0 where none
    return total


def compute_buffers(m: GgufModel, h: Hparams, a: LlamaArgs, c: Context, p: Placement) \
        -> tuple[dict[str, int], str, list[str]]:
    """Each backend's compute buffer, the method, notes."""
    notes: list[str] = []
    mem = h.memory
    replayed = graphs.replays(m, h)
    if replayed:
        notes += graphs.caveats(m, h)
        if any(attn_rotation(h, a)):
            notes.append(f"{h.arch}: the quantized cache's Hadamard rotations (four more matrix products per "
                         "attention layer) are replayed in the llama family's graph only, not in this one -- its "
                         "compute buffer may be low by those tensors")
    if not replayed and mem is not None and (mem.kind != "kv" or mem.mla):
        what = "MLA" if mem.kind == "kv" else "recurrent-state (SSM / WKV / short-convolution)"
        notes.append(f"{h.arch}: its {what} nodes are not replayed -- the compute buffer is the llama family's graph "
                     "over the same widths, approximate and likely low (4 to 69 % under llama.cpp's own on the "
                     "tiny models of the architectures now replayed, docs/llamacpp.md); the KV and RS buffers are "
                     "llama.cpp's own rules")
    elif not replayed and h.arch not in GRAPH_ARCHS:
        notes.append(f"{h.arch}: its graph is priced as the llama family's (the same attention and feed-forward "
                     "shapes); its own extra nodes are not replayed")
    n_tokens = min(c.n_ctx, c.n_ubatch)
    n_outputs = min(n_tokens, c.n_batch)
    own = f"{h.arch}'s own graph (src/models/{graphs.SOURCES[h.arch]}), " if replayed else ""
    method = (f"graph reservation replayed: {own}{h.n_layer} layers, {n_tokens} tokens x {c.n_ctx_seq} cells, "
              f"flash attention {'on' if c.flash_attn else 'off'} (ggml-alloc best fit)")
    reservations = ((n_tokens, n_outputs), (c.n_seq_max, c.n_seq_max))

    def graph(t: int, o: int, layers=None, with_output=True):
        if replayed:
            return graphs.build(m, h, c, t, o, range(h.n_layer) if layers is None else layers, with_output)
        return build_graph(m, h, a, c, t, o, layers, with_output)

    def peak(align: int, layers=None, with_output=True) -> int:
        return max(run_allocator(graph(t, o, layers, with_output), align) for t, o in reservations)

    if not p.gpus:
        return {"CPU": peak(CPU_ALIGN)}, method, notes
    out: dict[str, int] = {}
    on_gpu = [il for il in range(h.n_layer) if p.layers[il] is not None]
    for g_idx in p.gpus:
        mine = [il for il in on_gpu if p.layers[il] == g_idx]
        has_out = p.output == g_idx
        if not mine and not has_out:
            continue
        layers = range(mine[0], mine[-1] + 1) if mine else range(0)
        out[f"{a.gpu_backend}{g_idx}"] = peak(CUDA_ALIGN, layers, has_out)
    cpu_layers = [il for il in range(h.n_layer) if p.layers[il] is None]
    host_name = f"{a.gpu_backend}_Host"
    if replayed:  # this tree's own inputs (its KQ mask f16 with flash attention, the state copy ids ...)
        host = max(input_bytes(graph(t, o), CPU_ALIGN) for t, o in reservations)
        notes.append(f"{h.arch}: the GPU buffers replay the graph of the llama.cpp vendored here with CUDA's 128-byte "
                     "alignment, held against its CPU log only (tests/test_llamacpp.py), not yet against a GPU's")
    else:
        host = max(host_inputs(h, a, c, t, o) for t, o in reservations)
    if cpu_layers or p.output is None:
        host = max(host, peak(CPU_ALIGN, range(cpu_layers[0], cpu_layers[-1] + 1) if cpu_layers else range(0),
                              p.output is None))
        notes.append("partial offload: each device's compute buffer is its own layers' graph; the scheduler's "
                     "copies between devices (and weights it offloads to the GPU for large batches) are not "
                     "priced -- approximate")
    out[host_name] = host
    if not replayed:
        notes.append("GPU compute buffers follow the same replay with CUDA's 128-byte alignment (held against "
                     "published GPU logs: docs/validation.md, the llama.cpp section)")
    return out, method, notes
