import sys, os, re, subprocess
sys.path.insert(0, '/tmp/ptx'); sys.path.insert(0, '/work/main')
import triton
from compile import compile_one
from bento_pagedllm.kernels import gemv, gemv_v, gemv_w

def analyse(k, path):
    open(path + '.cubin', 'wb').write(k.asm['cubin'])
    b = os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin')
    s = subprocess.run([b + '/nvdisasm', '-c', path + '.cubin'], capture_output=True, text=True).stdout
    open(path + '.sass', 'w').write(s)
    res = subprocess.run([b + '/cuobjdump', '--dump-resource-usage', path + '.cubin'], capture_output=True, text=True).stdout
    regs = re.search(r'REG:(\d+)', res); stack = re.search(r'STACK:(\d+)', res)
    loops = re.findall(r'(\.L_x_\d+):', s)
    out = []
    for lab in loops:
        start = s.index(lab + ':')
        m = re.search(r'BRA `\(' + re.escape(lab) + r'\)', s[start:])
        if not m: continue
        body = s[start:start + m.start()]
        lines = [l for l in body.splitlines() if re.search(r'/\*[0-9a-f]{4}\*/', l)]
        # for each LDG: how many instructions between loop start and it, and whether a use of an earlier load dest precedes it
        ldg = [i for i, l in enumerate(lines) if 'LDG' in l]
        out.append((lab, len(lines), ldg))
    return (regs.group(1) if regs else '?', stack.group(1) if stack else '?', out)

CONFIGS = {
  'gate_up 1x512x2': (dict(ADD_RESIDUAL=False, RMS_NORM=True, SWIGLU=True, ADD_TO_OUTPUT=False, USE_PDL=True, BLOCK_M=1, BLOCK_N=1, BLOCK_K=512, INTERLEAVE=128), 2),
  'gate_up 4x1024x4': (dict(ADD_RESIDUAL=False, RMS_NORM=True, SWIGLU=True, ADD_TO_OUTPUT=False, USE_PDL=True, BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, INTERLEAVE=128), 4),
  'gate_up 2x1024x4': (dict(ADD_RESIDUAL=False, RMS_NORM=True, SWIGLU=True, ADD_TO_OUTPUT=False, USE_PDL=True, BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024, INTERLEAVE=128), 4),
  'gate_up 8x512x4': (dict(ADD_RESIDUAL=False, RMS_NORM=True, SWIGLU=True, ADD_TO_OUTPUT=False, USE_PDL=True, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, INTERLEAVE=128), 4),
  'gate_up 1x2048x4': (dict(ADD_RESIDUAL=False, RMS_NORM=True, SWIGLU=True, ADD_TO_OUTPUT=False, USE_PDL=True, BLOCK_M=1, BLOCK_N=1, BLOCK_K=2048, INTERLEAVE=128), 4),
  'gate_up 2x2048x8': (dict(ADD_RESIDUAL=False, RMS_NORM=True, SWIGLU=True, ADD_TO_OUTPUT=False, USE_PDL=True, BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048, INTERLEAVE=128), 8),
  'qkv 32x256x8': (dict(ADD_RESIDUAL=False, RMS_NORM=True, SWIGLU=False, ADD_TO_OUTPUT=False, USE_PDL=True, BLOCK_M=1, BLOCK_N=32, BLOCK_K=256, INTERLEAVE=0), 8),
  'lm 2x256x1': (dict(ADD_RESIDUAL=False, RMS_NORM=True, SWIGLU=False, ADD_TO_OUTPUT=False, USE_PDL=True, BLOCK_M=1, BLOCK_N=2, BLOCK_K=256, INTERLEAVE=0), 1),
  'o 1x512x1': (dict(ADD_RESIDUAL=False, RMS_NORM=False, SWIGLU=False, ADD_TO_OUTPUT=True, USE_PDL=True, BLOCK_M=1, BLOCK_N=1, BLOCK_K=512, INTERLEAVE=0), 1),
}
if __name__ == '__main__':
    names = sys.argv[1:] or list(CONFIGS)
    for name in names:
        c, w = CONFIGS[name]
        for tag, mod in (("main", gemv), ("v", gemv_v), ("w", gemv_w)):
            k = compile_one(mod._gemv_kernel, c, w)
            print(triton.__version__, name, tag, analyse(k, '/tmp/ptx/' + name.replace(' ', '_') + '_' + tag))
