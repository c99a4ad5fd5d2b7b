"""`python -m portable_fsdp.selftest`: prove a machine before a long run.

On the machine at hand, at smoke size, every plan feature the capability table says the chosen backend honours
there is trained and compared with one CPU process on the same initial weights and batches (the crosscheck's
machinery); checkpoints are saved, resumed and exported; the devices' matmul rate and collective bandwidth are
measured against their datasheet. One table, `selftest.json`, and exit 1 naming any row that failed.

    features.py  the rows, as data, and which of them a backend honours on this machine
    runs.py      running a row (the run itself, its CPU reference, resumes) and judging it
    probe.py     the worker job that measures the devices (matmul, all-reduce, memory)
    report.py    the table and selftest.json
    __main__.py  the command
"""
