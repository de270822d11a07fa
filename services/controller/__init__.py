"""The controller: environment mix, dataset cursors, and the admission window that bounds staleness."""
