"""Drop-in modules that mirror other libraries' Python APIs."""
