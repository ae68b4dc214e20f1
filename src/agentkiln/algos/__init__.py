"""Pure torch functions: advantage estimators and policy losses."""
