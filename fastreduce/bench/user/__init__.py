"""Scripts written as a user writes them, run by ``fastreduce bench exits`` (:mod:`..exits`):
no ``fastreduce.shutdown()``, no ``destroy_process_group()``, no ``os._exit``; whatever
fastreduce starts must stop by itself and each process exit 0."""
