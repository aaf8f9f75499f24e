"""Serving: the engine (continuous batching over paged KV blocks and Mamba state slots, prefix caching
across requests), the memory plan of its pools (`capacity`), the OpenAI-compatible API over it, and a
terminal chat over it.

    blocks.py, slots.py      the two pools          paged_cache.py   the Cache of one packed step
    scheduler.py, request.py admission, chunks, preemption           engine.py        Engine
    speculation.py           MTP drafts verified in the engine's steps
    prefix.py, prefix_file.py  prefix caching and its file           capacity.py      what a budget holds
    runner.py                the engine's loop beside the server     text.py          text, stop strings, <think>
    api.py, serve.py         the HTTP API and `hybrid serve`
    messages.py              chat prompts, sampling defaults         chat.py          `hybrid chat`
"""
