"""ntx-openai: the OpenAI HTTP API in front of one or more ntransformerd daemons.

An unprivileged program on the client side: it reaches the daemons only through ntx_client and
serves HTTP on 127.0.0.1:8000 by default. Needs the `openai` extra:
pip install 'ntransformer[openai]'.
"""
