"""Console entry points that wire layers together: they sit above the trainer and the evaluation
package (``tests/test_layers.py``), so neither of those has to import the other upward."""
