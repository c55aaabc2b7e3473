"""The GPU validation of memfit in one entry point: correctness, the seed's BERT-large table,
sharding, the planner against the allocator, offload and the CLI, on one H100/H200.

    PYTHONPATH=. python3 -m benchmarks.gpu --time-budget 540 [--out DIR] [--parts adfbcighje] [--smoke]

Parts (each a function ``run(env) -> dict`` of figures and checks; docs/gpu-validation.md
says what each measures and its goal):

    a  correctness   benchmarks/gpu/correctness.py  (+ _probe.py: the race probe)
    b  bert          benchmarks/gpu/bert.py
    c  sharding      benchmarks/gpu/sharding.py
    d  planner       benchmarks/gpu/planner.py
    e  offload       benchmarks/gpu/offload.py
    f  train         benchmarks/gpu/train.py
    g  autoconfig    benchmarks/gpu/autoconfig.py
    h  two_ranks     benchmarks/gpu/two_ranks.py
    i  calibrate     benchmarks/gpu/calibrate.py
    j  host_tier     benchmarks/gpu/host_tier.py

``--time-budget`` plans the parts to fit (most valuable first: __main__.PRIORITY) and prints
the plan before it starts; a second call with the same ``--out`` runs what the first left.

It writes ``gpu_<device>.json`` (every figure) and ``gpu_<device>.md`` into ``--out`` after
each part, merging with what an earlier call of the same device wrote there, so a run cut at
its time limit keeps the parts it finished and the validation can be split over two calls
(``--parts a,d,e,f`` then ``--parts b,c``). A part that raises is recorded with its traceback
and the run goes on; a part past its time limit (``--part-timeout``) is stopped the same way.

Software: the GPU machine's own (torch 2.11, transformers 5.x, pytest); nothing travels with
the run but this working tree (memfit imported from it: PYTHONPATH=.). No extra wheels.

``--smoke`` runs every part on the CPU with tiny shapes (tests/integration/test_gpu_script.py):
it checks the script's code paths, not the GPU. CUDA-only calls take their CPU stand-ins there.
"""
