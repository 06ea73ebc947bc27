"""The tokenizer process: prompt tokenization, chat templates and incremental detokenization,
between the frontend socket and the engine core."""
