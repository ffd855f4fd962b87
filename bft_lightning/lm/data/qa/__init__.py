"""Question answering data for supervised fine-tuning of a causal LM.

Readers (one ``QAExample`` per question):

- SQuAD JSON, v1.1 and v2.0 (unanswerable questions have ``answers == []``;
  their target is the empty answer, i.e. EOS right away, which is what the
  v2.0 metric rewards);
- HotpotQA distractor JSONL, in the IRCoT layout and the original layout
  (2 gold paragraphs plus the dataset's own distractors);
- NQ-open with its gold passage (``*.jsonl.gz``, the *Lost in the Middle* oracle file);
- RGB ``en_fact.json`` (positive snippets are gold, negatives are the distractors).

Splits are by ``group`` and never by question: the SQuAD article title (so no
context is shared across splits), the NQ gold-passage title, the HotpotQA /
RGB question id.

A training sequence is ``BOS passages "\\n\\nQuestion: q\\nAnswer:" " answer" EOS``
and the loss is on the answer tokens (and the EOS) only. When it is too long,
distractors go first, then gold passages are cropped, the answer-bearing one
to a window around the answer, so the answer is never cut out of its gold
passage (an example whose answer cannot fit is dropped, counted and reported;
a split left empty is an error).

Noise:

- label corruption (``noise_rate`` = ``np``): each answer label token (not the
  EOS) of a *training* example is replaced, with probability ``np``, by a token
  drawn uniformly from the non-special vocabulary minus the original token;
  the draw is fixed per example by ``seed`` and the question id alone (a fixed
  noisy dataset, the same whatever the distractors or the subset), inputs
  stay clean (teacher forcing reads the clean answer);
- distractors (``num_distractors`` = ``k``): ``k`` passages from other groups
  of the same split (``"other_articles"``), other paragraphs of the same
  article (``"same_article"``) or the dataset's own (``"dataset"``); the gold
  passages are inserted at random positions among them (seeded per example).

The data root is ``data_root``, else ``$BFT_DATA_ROOT``, else ``data`` (under the
working directory).

Where each part lives: ``examples.py`` (``QAExample``, ``Passage``, the
datasets' files), ``readers.py`` (a reader per dataset family; a new dataset
is a reader there and a line in ``DATASETS``), ``encoding.py`` (tokenizer and
prompt), ``noise.py`` (label corruption, distractors), ``batching.py``
(collation), ``datamodule.py`` (``QADataModule``), ``pretrain.py``
(``QAPretrainDataModule``).
"""

from __future__ import annotations

from .batching import (
    IGNORE_INDEX,
    collate_qa,
    collate_rows,
    collate_text,
    document_rows,
    text_chunks,
)
from .datamodule import QADataModule
from .encoding import (
    PASSAGE_SEP,
    QUESTION_TEMPLATE,
    EncodedExample,
    crop_around,
    encode_example,
    target_answer,
    train_bpe_tokenizer,
)
from .examples import DATASETS, REPO_ROOT, Passage, QAExample, data_root, resolve_data_file
from .noise import DISTRACTOR_SOURCES, arrange_passages, corrupt_labels, passage_pool
from .pretrain import QAPretrainDataModule, cloze_examples
from .readers import (
    read_dataset,
    read_hotpotqa,
    read_nq_open,
    read_qa,
    read_rgb,
    read_squad,
    split_by_group,
)

__all__ = [
    "DATASETS",
    "DISTRACTOR_SOURCES",
    "IGNORE_INDEX",
    "PASSAGE_SEP",
    "QUESTION_TEMPLATE",
    "REPO_ROOT",
    "EncodedExample",
    "Passage",
    "QADataModule",
    "QAExample",
    "QAPretrainDataModule",
    "arrange_passages",
    "cloze_examples",
    "collate_qa",
    "collate_rows",
    "collate_text",
    "document_rows",
    "corrupt_labels",
    "crop_around",
    "data_root",
    "encode_example",
    "passage_pool",
    "read_dataset",
    "read_hotpotqa",
    "read_nq_open",
    "read_qa",
    "read_rgb",
    "read_squad",
    "resolve_data_file",
    "split_by_group",
    "target_answer",
    "text_chunks",
    "train_bpe_tokenizer",
]
