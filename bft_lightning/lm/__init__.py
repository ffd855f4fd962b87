"""The language model: a Llama-style causal LM whose layers are BFT decoder layers.

One room with everything the LM has and the recommenders do not (no recommender
module imports it; it imports ``nn``, the shared filter core, where its decoder
layer lives beside the encoder and HSTU blocks):

- ``model.py``: ``LlamaForCausalLM`` / ``LlamaModel`` (generation, KV cache,
  Llama-format loading and saving); ``config.py``: ``LlamaConfig`` (the
  ``config.json`` fields) and the tensor-shape checks; ``options.py``:
  ``BFTOptions`` (a ``FilterConfig`` plus the LM's prior and dropout);
- ``precision_calibration.py``: the precision calibration of a pretrained model;
- ``llama_format.py`` (+ ``llama_files.py``): reading and writing Llama-format
  folders, checked before anything is allocated; ``tokenizer.py``: ``tokenizer.json``;
- ``data/``: the QA data (``data/qa/``) and the synthetic QA world (``data/synthetic_qa.py``);
- ``task.py``: ``LanguageSFT``; ``losses.py``: the token losses; ``metrics.py``: QA EM / F1.

Importing this package loads nothing; import the module you need.
"""
