import json,glob,os,sys
d=sys.argv[1]
for f in sorted(glob.glob(d+'/*.json')):
    j=json.load(open(f)); n=os.path.basename(f)
    if 'models' in j:
        m=j['models']['llama2-7b']; e=m['engine']
        print(n, 'bw', round(j['copy_bandwidth_tbs'],4), 'tok/s', round(e['decode_tok_s'],2), 'ratio', round(e['decode_tok_s']/m['roofline_tok_s'],4))
    else:
        print(n, 'req/s', round(j['request_throughput'],3), 'dur', round(j['duration_s'],3), 'preempt', j.get('preemptions'))
