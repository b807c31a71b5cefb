import ctypes, sys, torch, bitsandbytes as bnb
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena","ordblks","smblks","hblks","hblkhd","usmblks","fsmblks","uordblks","fordblks","keepcost")]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MI
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
mode = sys.argv[1]
shapes = [(4864, 896)] * 3 + [(896, 896), (128, 896), (128, 896), (896, 896)]
if len(sys.argv) > 2 and sys.argv[2] == "llama":
    shapes = [(8192, 2048)] * 3 + [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048)]
layers = 24
src = torch.empty(max(a*b for a, b in shapes), dtype=torch.bfloat16).normal_()
keep = []
r0 = rss(); m0 = libc.mallinfo2()
for i in range(layers):
    for (o, n) in shapes:
        w = src[: o * n].view(o, n)
        if mode == "nf4":
            p = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4").to("cpu")
        else:
            p = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False).to("cpu")
        keep.append(p)
m = libc.mallinfo2()
print(f"{mode} rss+{(rss()-r0)/2**20:.0f} MiB arena+{(m.arena-m0.arena)/2**20:.0f} in_use+{(m.uordblks-m0.uordblks)/2**20:.0f} free {m.fordblks/2**20:.0f} mmapped {m.hblkhd/2**20:.0f}")
