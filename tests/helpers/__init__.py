"""Helpers shared by the tests (builders, stand-ins, fixtures' bodies, child-process entry points); no tests here."""
