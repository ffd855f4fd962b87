"""The language model's data: QA sets (``qa/``) and the synthetic QA world
(``synthetic_world.py``, ``synthetic_qa.py``)."""
