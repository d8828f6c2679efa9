// MathJax 3 for the notebooks' markdown ($...$ and $$...$$), loaded from this site (assets/vendor/mathjax), never a CDN.
// Only notebooks' markdown cells are typeset: code and outputs may contain dollar signs that are not math. MathJax
// skips a subtree whose class matches ignoreHtmlClass (the theme's containers hold the whole page) until an element
// matches processHtmlClass; do not use the usual ".*|", which also matches the empty class of a <p> inside a cell.
window.MathJax = {
  tex: {
    inlineMath: [["$", "$"], ["\\(", "\\)"]],
    displayMath: [["$$", "$$"], ["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: "md-container|md-header|md-dialog",
    processHtmlClass: "jp-MarkdownOutput|jp-RenderedLatex|arithmatex",
    enableMenu: false,  // the menu's accessibility options would load the speech-rule engine from a CDN
  },
  svg: { fontCache: "global" },
};
