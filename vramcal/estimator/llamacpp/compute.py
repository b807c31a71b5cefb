"""The compute buffers: llama.cpp's graph reservation, replayed.

At context creation llama.cpp builds its worst-case graph -- one ubatch of ``n_ubatch`` tokens (and one
of ``n_seq_max`` tokens), every KV cell in view -- and has ggml's graph allocator place every
intermediate tensor (llama-context.cpp ``sched_reserve`` -> ``graph_reserve`` ->
``ggml_backend_sched_reserve``). The compute buffer is the highest offset that allocator reaches:
``ggml_dyn_tallocr`` (ggml-alloc.c), best fit among freed blocks, else the end of the buffer; a tensor
is freed when its last consumer ran; an op that ggml may run in place (``ggml_op_can_inplace``: ADD,
MUL, RMS_NORM, ROPE, SOFT_MAX, UNARY ...) takes its parent's memory when it is the parent's only
consumer.

Here the same graph is written down node by node for the llama family of decoders (src/models/llama.cpp
and the gemma2/gemma3 variants with their extra norms, scaling and soft-capping; dense or MoE feed
forward; flash attention or KQ + soft_max), with each tensor's ggml shape and type, and the same
allocator is run over it. Inputs (tokens, positions, the KQ mask -- f16 with flash attention, f32
without --, the KV row indices) are allocated first, as ggml allocates graph inputs.

Where the graph runs on several devices (a partial -ngl, several GPUs) ggml's scheduler cuts it into
splits per backend and copies tensors between them; that is priced as each device's own layers'
graph, plus the graph inputs the scheduler keeps on the GPU host (``CUDA_Host``, :func:`host_inputs`).
Against published CUDA, Vulkan and Metal logs (docs/validation.md, the llama.cpp section) a full offload's
GPU buffer is within 3 % wherever the build lays the cache and the ubatch out as today's (2024 builds and a
shared multi-sequence cache differ); a partial offload's, and the scheduler's copies between devices (and
pipeline parallelism's), remain approximate and the notes say so.
"""

from __future__ import annotations

from dataclasses import dataclass

from .buffers import CPU_ALIGN, CUDA_ALIGN, Context, Hparams, LlamaArgs, Placement, row_size, swa_cells
from .gguf_file import GgufModel

F32, F16, I32, I64 = 4, 2, 4, 8
INPLACE = {"add", "mul", "scale", "rms_norm", "rope", "soft_max", "unary"}
GRAPH_ARCHS = ("llama", "gemma2", "gemma3", "qwen2", "qwen3", "mistral3", "qwen3moe", "qwen2moe", "granite", "phi3")


@dataclass(eq=False)
class Node:
    op: str
    nbytes: int
    srcs: tuple = ()
    view_of: Node | None = None
    is_input: bool = False
    is_output: bool = False
    layout: tuple = ()  # same layout = same bytes and shape: the in-place test
    # allocator state
    children: int = 0
    views: int = 0
    offset: int | None = None
    allocated: bool = False


class Graph:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.leafs: list[Node] = []

    def input(self, nbytes: int) -> Node:
        n = Node("input", nbytes, is_input=True, layout=(nbytes,))
        self.leafs.append(n)
        return n

    def op(self, op: str, nbytes: int, *srcs: Node | None, layout: tuple | None = None) -> Node:
        n = Node(op, nbytes, tuple(s for s in srcs if s is not None), layout=layout or (nbytes,))
        self.nodes.append(n)
        return n

    def view(self, src: Node, layout: tuple | None = None) -> Node:
        base = src.view_of or src
        n = Node("view", src.nbytes, (src,), view_of=base, layout=layout or src.layout)
        self.nodes.append(n)
        return n

    def weight_op(self, op: str, nbytes: int, *srcs: Node | None) -> Node:
        return self.op(op, nbytes, *srcs)


class Allocator:
    """ggml-alloc.c's ``ggml_dyn_tallocr``: free blocks by offset, best fit but the last, which grows."""

    def __init__(self, align: int) -> None:
        self.align = align
        self.blocks: list[list[int]] = [[0, 1 << 62]]
        self.max_size = 0

    def alloc(self, size: int) -> int:
        size = (size + self.align - 1) // self.align * self.align
        best = -1
        for i, (_, bsize) in enumerate(self.blocks[:-1]):
            if bsize >= size and (best < 0 or bsize <= self.blocks[best][1]):
                best = i
        if best < 0:
            best = len(self.blocks) - 1
        off = self.blocks[best][0]
        self.blocks[best][0] += size
        self.blocks[best][1] -= size
        if self.blocks[best][1] == 0:
            del self.blocks[best]
        self.max_size = max(self.max_size, off + size)
        return off

    def free(self, off: int, size: int) -> None:
        size = (size + self.align - 1) // self.align * self.align
        for i, b in enumerate(self.blocks):
            if b[0] + b[1] == off:
                b[1] += size
                if i + 1 < len(self.blocks) and b[0] + b[1] == self.blocks[i + 1][0]:
                    b[1] += self.blocks[i + 1][1]
                    del self.blocks[i + 1]
                return
            if off + size == b[0]:
                b[0], b[1] = off, b[1] + size
                return
        at = next((i for i, b in enumerate(self.blocks) if b[0] > off), len(self.blocks))
        self.blocks.insert(at, [off, size])


def _allocate(g: Graph, a: Allocator, n: Node) -> None:
    if n.allocated or n.view_of is not None:
        return
    n.allocated = True
    if n.op in INPLACE:
        for p in n.srcs:
            if p.is_output or (p.view_of is not None and p.view_of.is_output):
                continue
            if p.layout != n.layout or p.children != 1 or p.views != 0:
                continue
            if p.view_of is not None:
                src = p.view_of
                if src.views == 1 and src.children == 0 and src.offset is not None:
                    n.offset, src.allocated, p.allocated = src.offset, False, False
                    return
                continue
            if p.offset is None:
                continue
            n.offset, p.allocated = p.offset, False
            return
    n.offset = a.alloc(n.nbytes)


def _free(a: Allocator, n: Node) -> None:
    if n.allocated and n.offset is not None and not n.is_output:
        a.free(n.offset, n.nbytes)
        n.allocated = False


def run_allocator(g: Graph, align: int) -> int:
    """The highest offset ggml's graph allocator reaches for ``g`` (ggml-alloc.c
    ``ggml_gallocr_alloc_graph_impl``): leafs first, then inputs, then each node after its parents,
    freeing a parent (and a view's source) when its last consumer has run."""
    a = Allocator(align)
    for leaf in g.leafs:
        _allocate(g, a, leaf)
    for n in g.nodes:
        if n.view_of is not None:
            n.view_of.views += 1
        for s in n.srcs:
            s.children += 1
    for n in g.nodes:
        for p in n.srcs:
            _allocate(g, a, p)
        _allocate(g, a, n)
        for p in n.srcs:
            p.children -= 1
            if p.children == 0 and p.views == 0:
                if p.view_of is not None:
                    src = p.view_of
                    src.views -= 1
                    if src.views == 0 and src.children == 0:
                        _free(a, src)
                else:
                    _free(a, p)
    return a.max_size


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

    # graph inputs in the order ggml's graph walk meets them (its leafs): tokens, positions, the KV row
    # indices at the first set_rows, the masks at the first attention, out_ids at the last layer
    v_max = max((h.n_embd_v_gqa(il) for il in range(h.n_layer)), default=0)
    keys = ["base", "swa"] if swa else ["base"]
    idx = {key: (g.input(T * I64), g.input(T * (1 if fa else v_max) * I64)) for key in keys}
    masks = {key: mask(n_kv_swa if key == "swa" else n_kv_base) for key in keys}
    inp = g.op("get_rows", E * T * F32, tokens)
    if gemma:
        inp = g.op("scale", E * T * F32, inp)
    out_ids = g.input(n_outputs * I32)  # always built (llama-graph.cpp build_inp_out_ids: constant topology)
    cur = inp
    n_layers = range(h.n_layer) if layers is None else layers
    last = h.n_layer - 1
    for il in n_layers:
        key = "swa" if h.is_swa[il] else "base"
        n_kv = n_kv_swa if key == "swa" else n_kv_base
        hq, hkv = h.n_head[il], h.n_head_kv[il]
        hd_k, hd_v = h.n_embd_head_k, h.n_embd_head_v
        inp_sa = cur
        x = g.op("rms_norm", E * T * F32, cur)
        x = g.op("mul", E * T * F32, x)
        # the order ggml_build_forward_expand leaves them in (GGML_SCHED_DEBUG=2): Q, its norm and rope, V, K
        q = g.op("mul_mat", hq * hd_k * T * F32, x)
        qv = g.view(q)
        if h.arch == "gemma3":
            qv = g.op("rms_norm", qv.nbytes, qv)
            qv = g.op("mul", qv.nbytes, qv)
        qr = g.op("rope", qv.nbytes, qv, pos)
        if gemma:
            qr = g.op("scale", qr.nbytes, qr)
        v = g.op("mul_mat", hkv * hd_v * T * F32, x)
        vv = g.view(v)
        k = g.op("mul_mat", hkv * hd_k * T * F32, x)
        kv = g.view(k)
        if h.arch == "gemma3":
            kv = g.op("rms_norm", kv.nbytes, kv)
            kv = g.op("mul", kv.nbytes, kv)
        kr = g.op("rope", kv.nbytes, kv, pos)
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
        o = g.op("mul_mat", E * T * F32, att)
        if gemma:
            o = g.op("rms_norm", o.nbytes, o)
            o = g.op("mul", o.nbytes, o)
        if il == last:
            o = g.op("get_rows", E * n_outputs * F32, o, out_ids)
            inp_sa = g.op("get_rows", E * n_outputs * F32, inp_sa, out_ids)
            T = n_outputs
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
    attention casts it to f16 on the device) --, and the output ids. Inputs are never freed, so the buffer
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
    for n_kv in cells:
        total += pad(n_kv * per_stream * c.n_stream * F32)
        total += pad(T * I64) + pad(T * (1 if c.flash_attn else v_max) * I64)
    return total


def compute_buffers(m: GgufModel, h: Hparams, a: LlamaArgs, c: Context, p: Placement) \
        -> tuple[dict[str, int], str, list[str]]:
    """Each backend's compute buffer, the method, notes."""
    notes: list[str] = []
    mem = h.memory
    if mem is not None and (mem.kind != "kv" or mem.mla):
        what = "MLA" if mem.kind == "kv" else "recurrent-state (SSM / WKV / short-convolution)"
        notes.append(f"{h.arch}: its {what} nodes are not replayed -- the compute buffer is the llama family's graph "
                     "over the same widths, approximate and likely low (4 to 69 % under llama.cpp's own on tiny "
                     "models, docs/llamacpp.md); the KV and RS buffers are llama.cpp's own rules")
    elif h.arch not in GRAPH_ARCHS:
        notes.append(f"{h.arch}: its graph is priced as the llama family's (the same attention and feed-forward "
                     "shapes); its own extra nodes are not replayed")
    n_tokens = min(c.n_ctx, c.n_ubatch)
    n_outputs = min(n_tokens, c.n_batch)
    method = (f"graph reservation replayed: {h.n_layer} layers, {n_tokens} tokens x {c.n_ctx_seq} cells, "
              f"flash attention {'on' if c.flash_attn else 'off'} (ggml-alloc best fit)")

    def peak(align: int, layers=None, with_output=True) -> int:
        best = 0
        for t, o in ((n_tokens, n_outputs), (c.n_seq_max, c.n_seq_max)):
            best = max(best, run_allocator(build_graph(m, h, a, c, t, o, layers, with_output), align))
        return best

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
    host = max(host_inputs(h, a, c, t, o) for t, o in ((n_tokens, n_outputs), (c.n_seq_max, c.n_seq_max)))
    if cpu_layers or p.output is None:
        host = max(host, peak(CPU_ALIGN, range(cpu_layers[0], cpu_layers[-1] + 1) if cpu_layers else range(0),
                              p.output is None))
        notes.append("partial offload: each device's compute buffer is its own layers' graph; the scheduler's "
                     "copies between devices (and weights it offloads to the GPU for large batches) are not "
                     "priced -- approximate")
    out[host_name] = host
    notes.append("GPU compute buffers follow the same replay with CUDA's 128-byte alignment (held against "
                 "published GPU logs: docs/validation.md, the llama.cpp section)")
    return out, method, notes
