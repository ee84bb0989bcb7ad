"""The comparison report. It only reads run directories (and the files `dpcompare compare` wrote beside
them: each run's sample.json, the diagnoses under <out>/diagnosis/); it starts no training, sampling or
diagnosis of its own. writer.py puts it together; findings.py computes, render.py and markup.py write."""
