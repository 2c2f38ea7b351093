// MathJax 2's configuration, read when docs/gen_pages.py's copy of it (mathjax/MathJax.js,
// from the jupyter-server-mathjax package: nothing is loaded from the network) starts.
// Only the tutorials' cells hold TeX ($...$ and $$...$$, as Jupyter writes it); the rest
// of the site is left alone, so that a dollar sign in prose stays one.
window.MathJax = {
  // The combined configuration that package ships (TeX in, HTML-CSS out), as Jupyter's
  // classic notebook loaded it.
  config: ["TeX-AMS-MML_HTMLorMML-full.js"],
  tex2jax: {
    inlineMath: [["$", "$"], ["\\(", "\\)"]],
    displayMath: [["$$", "$$"], ["\\[", "\\]"]],
    processEscapes: true,
    ignoreClass: "md-content",
    processClass: "jupyter-wrapper",
  },
  // The STIX-Web fonts copied with it: no local or remote font to look for.
  "HTML-CSS": { availableFonts: [], webFont: "STIX-Web", imageFont: null },
  showMathMenu: false,
  messageStyle: "none",
};
