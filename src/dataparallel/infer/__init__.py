"""Inference with data-parallel workers: `dataparallel generate` and `dataparallel eval`.

    sampling.py   a built-in GPT's weights file -> model; `dataparallel sample`'s sampler
    model_loading.py  a run directory or a save_pretrained directory -> model and tokenizer
    decoding.py   batched decoding with a fixed number of forwards (greedy or sampled)
    generate.py   prompts split across ranks, batched, gathered back in input order
    evaluate.py   the exact perplexity of a dataset, summed over ranks
    ranks.py      shares of the work, and the few numbers the ranks exchange
    worker.py     one worker (started by the shared launcher, launch/workers.py)
    command.py    the two commands' flags and checks

The workers are started by the launcher that `dataparallel train` uses too (launch/workers.py);
nothing here imports train/.
"""
