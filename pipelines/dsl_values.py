"""A mixin for objects the CuTe DSL passes through dynamic control flow untouched."""


class NoLoopCarriedValues:
    """Passed through the DSL's dynamic loops and branches unchanged.

    A pipeline object carries no loop-carried run-time values (its barrier pointers and pair
    ranks are defined before any loop), so loops and branches that call its methods need not
    thread it through as loop state.
    """

    def __get_mlir_types__(self):
        return []

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self
