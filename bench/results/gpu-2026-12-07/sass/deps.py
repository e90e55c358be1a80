import re, sys
def loop_lines(path, label='.L_x_1'):
    s = open(path).read()
    start = s.index(label + ':')
    m = re.search(r'BRA `\(' + re.escape(label) + r'\)', s[start:])
    body = s[start:start + m.start()]
    return [re.sub(r';.*', '', l.split('*/', 1)[1]).strip() for l in body.splitlines() if re.search(r'/\*[0-9a-f]{4}\*/', l)]

def regs_of(op):
    return set(int(r) for r in re.findall(r'\bR(\d+)\b', op))

def report(path):
    lines = loop_lines(path)
    pending = {}  # reg -> ldg index
    waits = []
    for i, l in enumerate(lines):
        m = re.match(r'(@!?P\d\s+)?(\S+)\s*(.*)', l)
        opc, ops = m.group(2), m.group(3)
        parts = [p.strip() for p in ops.split(',')]
        if opc.startswith('LDG'):
            # a use of pending regs in the address?
            srcs = regs_of(','.join(parts[1:]))
            dst = int(re.search(r'R(\d+)', parts[0]).group(1))
            width = 4 if '.128' in opc else 2 if '.64' in opc else 1
            hit = srcs & set(pending)
            if hit: waits.append((i, 'addr', sorted(hit)))
            # WAR/WAW on pending dst regs counts as a wait too
            over = set(range(dst, dst + width)) & set(pending)
            if over: waits.append((i, 'overwrite', sorted(over)))
            for r in range(dst, dst + width): pending[r] = i
            print(f'{i:4d} LDG  {l[:70]}', '  <-- after waiting on' if (hit or over) else '')
        else:
            srcs = regs_of(','.join(parts[1:])) if opc not in ('CS2R',) else set()
            if opc in ('CS2R', 'MOV', 'IMAD.MOV.U32') : srcs = regs_of(','.join(parts[1:]))
            dsts = regs_of(parts[0]) if parts and parts[0] else set()
            used = srcs & set(pending)
            if used:
                print(f'{i:4d} use of load from {sorted(set(pending[r] for r in used))}: {l[:60]}'); 
                for r in used: pending.pop(r, None)
            for r in dsts & set(pending):  # overwritten before use (e.g. CS2R zeroing: a WAW wait)
                print(f'{i:4d} overwrite of pending load {pending[r]}: {l[:60]}'); pending.pop(r)
for p in sys.argv[1:]:
    print('==', p); report(p)
