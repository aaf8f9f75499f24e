"""Long-context recall evaluation.

    tasks.py      task generators (passkey, needle, phonebook, kv_recall, mqar) and `fit_to_length`
    ruler.py      RULER-style generators: niah (noise / needle haystacks), variable tracking, cwe, fwe
    vocab.py      word lists and random keys / values for the RULER tasks
    sample.py     the `Sample` record and shared generator helpers
    registry.py   task name -> metric, answer budget, depth axis, teacher forcing; task groups
    scoring.py    string_match_all / string_match_part / exact_match / MQAR accuracy; effective length
    runner.py     the evaluation loop: batches, greedy answers, teacher forcing, resumable JSONL
    results.py    CSV pivots and the summary table;  plots.py  heatmaps and accuracy vs length
    report.py     all tables and plots from a records file;  command.py  the command line
    lm_eval_adapter.py   the `hybrid` model for lm-evaluation-harness (optional extra `eval`)
"""
