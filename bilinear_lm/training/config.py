"""train.py's configuration errors."""


class TrainingInputError(ValueError):
    """Unusable user input to train.py (config keys and values, checkpoint paths, data that does not fit the model);
    the message says what to pass instead. The command line prints it as one line; anything else is a bug and keeps
    its traceback. (Data-pipeline problems raise `bilinear_lm.training.data.DataError`, printed the same way.)"""
