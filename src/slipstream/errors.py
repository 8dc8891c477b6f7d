"""The error every bad input ends in: one line that names the field or file and the fix.

Its own module so that the lowest layers (files.py) can raise it without importing the recipe.
`slipstream.recipe.RecipeError` is the same class.
"""


class RecipeError(ValueError):
    """A recipe field has a value that cannot be used; the message names the field and the fix."""
