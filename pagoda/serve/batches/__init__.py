"""OpenAI's Batch API: uploaded JSONL files of requests (/v1/files) run as batches (/v1/batches)
at low priority beside online traffic, persisted in SQLite so a restart resumes them.

protocol.py holds the bodies, store.py the SQLite store and the files' bytes beside it, files.py
the /v1/files routes, runner.py the task that validates batches and runs their lines through the
endpoints' own path, routes.py the /v1/batches reads and cancel (create is an entry of the
endpoint table, serve/endpoints.py).
"""
