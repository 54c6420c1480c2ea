def add_arguments(p): pass
def main(args): return 0
