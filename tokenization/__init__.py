"""Tokenization: a prompt or a conversation to the token ids the engines will see.

* ``tokenizers``: the tokenizer registry (which tokenizer a model uses, from where, loaded once);
* ``chat_templates``: conversations rendered as the model's chat template renders them, in a
  bounded Jinja environment;
* ``template_sandbox``: worker processes that render a request's own template under CPU, memory
  and time budgets;
* ``prefix_store``: reuse of a prompt prefix's tokens seen before (llm-d's prefix store);
* ``ascii_bpe``: ASCII text tokenized by ``tiktoken``, ``tokenizers``' answer at a sixth of its
  time, for tokenizers of the Qwen / GPT-4 shape;
* ``large_prompts``: very large prompts tokenized in a child process;
* ``priority``: the lower CPU priority that bulk work runs at.

May import: nothing of this project's. No Django, no index (``make lint``'s contracts).
"""
