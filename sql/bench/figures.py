"""The report step of the backend-CPU scripts (backend-cpu.sh's measure_all): reads what it wrote
into the work directory and prints the report's title, method, provenance and table."""
import statistics
import sys


def report(script, title, what="", flags="-c 1 -M prepared"):
    """Prints the head of the report of `script` (argv: work directory, transactions, rounds);
    `what` adds to the method, `flags` are pgbench's. Returns (runs, medians): per case its
    figures and their median."""
    work, tx, rounds = sys.argv[1:]
    runs = {}
    for line in open(f"{work}/figures"):
        case, us = line.split()
        runs.setdefault(case, []).append(int(us))
    print(f"# {title}\n")
    print(f"Written by `sql/bench/{script} {tx} {rounds}`: backend CPU per pgbench transaction "
          f"(`{flags}`, no TLS, `synchronous_commit = off`{what}), from the postmaster's "
          "cutime + cstime after the session exited; each case in a fresh database, the cases "
          f"alternating, medians of {rounds} rounds of {tx} transactions.\n")
    print(open(f"{work}/machine").read().strip() + "\n")
    return runs, {c: statistics.median(v) for c, v in runs.items()}


def table(names, runs, medians, base=None):
    """Prints one row per case of `names` (case: description), with its median and runs; with
    `base` (a case), also that case's median divided by each case's."""
    ratio = f" {base} ÷ case |" if base else ""
    print(f"| case | µs per transaction (median) |{ratio} runs |\n|---|---:|{'---:|' if base else ''}---|")
    for c, name in names.items():
        r = f" {medians[base] / medians[c]:.2f} |" if base else ""
        print(f"| {name} | {medians[c]:.0f} |{r} {', '.join(map(str, runs[c]))} |")
