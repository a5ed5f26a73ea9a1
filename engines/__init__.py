"""Real inference engines: the fleet of ``vllm serve`` processes that ``make run FLEET=vllm``
starts and registers (``manage.py vllm_fleet``, ``fleet.py``), the vLLM venv's set-up and the
random-weight model it serves (``prepare.py``, run by that venv's Python), and the pins of that
venv (``vllm-requirements.txt``).

May import: ``registry`` (to register its engines and their model), ``kvindex``,
``tokenization``, ``stack``; never ``ingest``, ``scoring``, ``gateway``, ``dashboard`` or
``simulator`` (``make lint``'s contracts). ``fleet.py`` and ``prepare.py`` import no Django.
"""
