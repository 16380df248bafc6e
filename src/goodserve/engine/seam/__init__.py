"""The plain data a step carries from the scheduler to the workers and back: picklable, imported without torch."""
