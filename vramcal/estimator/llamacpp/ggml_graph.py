"""ggml's graph and its allocator, replayed: the nodes llama.cpp's graph builders create and ggml-alloc.c's
``ggml_gallocr`` placing them (:mod:`.compute` describes the rules and the graphs written with them).

A graph is built one of two ways. Eagerly (:meth:`Graph.op`): each node is appended as it is created, the
order written down by hand. Or as ggml builds it (``Graph(lazy=True)``): nodes are created with their
sources, and :meth:`Graph.expand` appends them the way ``ggml_build_forward_expand`` does (ggml.c
``ggml_visit_parents_graph``: depth first, sources left to right, each node once, after its sources), the
graph inputs among them as leafs in the order the walk meets them -- the order ggml-alloc allocates them.
Lazy nodes carry their ggml shape (``ne``) and element size: the in-place test compares those. No op runs in
place on a view of any kind (:func:`_allocate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

F32, F16, I32, I64 = 4, 2, 4, 8
INPLACE = {"add", "sub", "mul", "div", "sqr", "scale", "clamp", "rms_norm", "rope", "soft_max", "unary"}


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
    def __init__(self, lazy: bool = False) -> None:
        self.nodes: list[Node] = []
        self.leafs: list[Node] = []
        self.lazy = lazy
        self._seen: set[int] = set()

    def _add(self, n: Node, to: list[Node]) -> Node:
        if not self.lazy:
            to.append(n)
        return n

    def input(self, nbytes: int) -> Node:
        return self._add(Node("input", nbytes, is_input=True, layout=(nbytes,)), self.leafs)

    def op(self, op: str, nbytes: int, *srcs: Node | None, layout: tuple | None = None) -> Node:
        return self._add(Node(op, nbytes, tuple(s for s in srcs if s is not None), layout=layout or (nbytes,)),
                         self.nodes)

    def view(self, src: Node, layout: tuple | None = None) -> Node:
        base = src.view_of or src
        return self._add(Node("view", src.nbytes, (src,), view_of=base, layout=layout or src.layout), self.nodes)

    def weight_op(self, op: str, nbytes: int, *srcs: Node | None) -> Node:
        return self.op(op, nbytes, *srcs)

    # shaped nodes: ggml's ne (innermost first) and element size
    def new_input(self, ne: tuple[int, ...], size: int = F32) -> Node:
        return self._add(Node("input", prod(ne) * size, is_input=True, layout=(size, *ne)), self.leafs)

    def t(self, op: str, ne: tuple[int, ...], *srcs: Node | None, size: int = F32) -> Node:
        """A new tensor of shape ``ne`` computed by ``op`` from ``srcs`` (weights are left out: they are not in the
        compute buffer)."""
        return self.op(op, prod(ne) * size, *srcs, layout=(size, *ne))

    def reshape(self, src: Node, ne: tuple[int, ...]) -> Node:
        """A contiguous view (``ggml_reshape``, a view at offset 0 with the source's strides)."""
        return self.view(src, layout=(src.layout[0], *ne))

    def strided(self, src: Node) -> Node:
        """A view at an offset or with other strides (``ggml_view_*``, ``ggml_permute``, ``ggml_transpose``)."""
        return self.view(src, layout=("strided", object()))

    def write(self, op: str, *srcs: Node) -> Node:
        """An op that writes into a buffer outside the graph (``set_rows`` into the KV cache, ``cpy`` or an
        in-place ``scale`` on a recurrent state): ggml returns a view of that buffer, so nothing is allocated."""
        return self._add(Node(op, 0, srcs, view_of=Node("external", 0), layout=("external",)), self.nodes)

    def expand(self, *tensors: Node) -> None:
        """``ggml_build_forward_expand``: each tensor after its sources, depth first, sources left to right."""
        for t in tensors:
            self._visit(t)

    def _visit(self, n: Node) -> None:
        if id(n) in self._seen:
            return
        self._seen.add(id(n))
        for s in n.srcs:
            self._visit(s)
        (self.leafs if n.is_input else self.nodes).append(n)


class Allocator:
    """ggml-alloc.c's ``ggml_dyn_tallocr``: free blocks by offset, best fit but the last, which grows."""

    def __init__(self, align: int) -> None:
        self.align = align
        self.blocks: list[list[int]] = [[0, 1 << 62]]
        self.max_size = 0

    def aligned(self, size: int) -> int:
        return (size + self.align - 1) // self.align * self.align

    def alloc(self, size: int) -> int:
        size = self.aligned(size)
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
        size = self.aligned(size)
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


def _allocate(a: Allocator, n: Node) -> None:
    """ggml-alloc.c ``ggml_gallocr_allocate_node``: an op ``ggml_op_can_inplace`` lists takes the memory of a
    parent that is "own" (``ggml_gallocr_is_own``: allocated by the graph allocator and not yet freed or handed
    on), not an output, of its layout and with no other consumer. A view is never own -- views are not
    allocated -- so nothing runs in place on a view: ggml's branch that would hand a view's source to the op
    never runs, and is not written here. That is the rule since ggml-alloc v3 (ggml PR #727, in llama.cpp from
    2024-02-11, PR #5452), the allocator of the vendored build and of every published log compared
    (docs/llamacpp.md); the 2023 allocator judged "own" by address, and reused views."""
    if n.allocated or n.view_of is not None:
        return
    n.allocated = True
    if n.op in INPLACE:
        for p in n.srcs:
            if p.allocated and not p.is_output and p.layout == n.layout and p.children == 1 and p.views == 0:
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
        _allocate(a, leaf)
    for n in g.nodes:
        if n.view_of is not None:
            n.view_of.views += 1
        for s in n.srcs:
            s.children += 1
    for n in g.nodes:
        for p in n.srcs:
            _allocate(a, p)
        _allocate(a, n)
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


def input_bytes(g: Graph, align: int) -> int:
    """The graph's inputs, each aligned: what ggml's scheduler keeps in the GPU host's buffer when the layers are
    on a GPU (inputs are assigned to the CPU backend and copied over, :func:`.compute.host_inputs`)."""
    return sum((n.nbytes + align - 1) // align * align for n in g.leafs if n.is_input)
