"""The labs' graders, one module per topic. Each grader is ``grade_x(impl, g: Grading)``."""
